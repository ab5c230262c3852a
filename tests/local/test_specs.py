"""BeginSave's shard specs: names that fit NAME_MAX, dtype and shape consistent with the size."""

from __future__ import annotations

import numpy as np
import pytest
from tierckpt._buffers import as_buffer
from tierckpt.errors import InvalidArgumentError
from tierckptd.local.staging import MAX_SHARD_NAME, check_layout, check_specs, dtype_itemsize


@pytest.mark.parametrize("obj", [np.zeros((3, 4), np.float32), np.array(2.5), np.zeros((0, 4), np.float16),
                                 np.array(["ab", "c"]), np.zeros(3, dtype="M8[ns]"), np.zeros(2, dtype="i4,f8"),
                                 b"raw", np.zeros(5, bool)])
def test_what_the_client_sends_is_accepted(obj):
    b = as_buffer("s", obj)
    check_specs([("s", b.nbytes, b.dtype, list(b.shape))], 1 << 40)


def test_torch_dtypes_have_itemsizes():
    import torch
    for dt in (torch.bfloat16, torch.float8_e4m3fn, torch.complex64, torch.bool, torch.int16):
        b = as_buffer("t", torch.zeros(3, dtype=dt))
        check_specs([("t", b.nbytes, b.dtype, list(b.shape))], 1 << 40)


@pytest.mark.parametrize("dtype,shape,size,field", [
    ("<f4", [3], 8, "shards.shape"),
    ("<f4", [], 8, "shards.shape"),  # 0-d: one element
    ("float32", [2], 8, "shards.dtype"),  # not the canonical string
    ("|O", [1], 8, "shards.dtype"),
    ("torch:nope", [8], 8, "shards.dtype"),
    ("x" * 100, [8], 8, "shards.dtype"),
    ("", [8], 8, "shards.shape"),
    ("<f4", [-1], 8, "shards.shape"),
    ("<f4", [1] * 65, 4, "shards.shape"),
])
def test_inconsistent_layouts_are_refused_naming_the_field(dtype, shape, size, field):
    with pytest.raises(InvalidArgumentError, match=field.replace(".", r"\.")):
        check_layout("s", size, dtype, shape)


def test_shard_names_must_leave_room_for_the_suffix():
    check_specs([("n" * MAX_SHARD_NAME, 1, "", ())], 1 << 40)
    with pytest.raises(InvalidArgumentError, match=r"shards\.name"):
        check_specs([("n" * (MAX_SHARD_NAME + 1), 1, "", ())], 1 << 40)


def test_itemsize():
    assert dtype_itemsize("<f8") == 8 and dtype_itemsize("torch:bfloat16") == 2
