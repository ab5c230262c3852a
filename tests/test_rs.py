"""Reed-Solomon GF(2^8) math (tierckptd.parity.rs): ISA-L through ctypes and the numpy fallback
write identical bytes, and any K of the K + M blocks decode the others."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from tierckptd.parity import gf, isal, rs

ISAL = isal.load({})
needs_isal = pytest.mark.skipif(ISAL is None, reason="ISA-L not loadable (pip install pyeclib==1.8.0)")


def _blocks(k: int, n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n, dtype=np.uint8) for _ in range(k)]


def test_field_tables_agree_with_isal_definition():
    # 2 is a generator of 0x11D: 255 distinct powers; a * inv(a) == 1 for every nonzero a
    assert len(set(gf.EXP[:255].tolist())) == 255
    assert all(gf.gf_mul(a, gf.gf_inv(a)) == 1 for a in range(1, 256))
    assert gf.gf_mul(0x80, 2) == 0x1D  # x^7 * x = x^8 = x^4 + x^3 + x^2 + 1
    assert gf.gf_inv(0) == 0


def test_force_numpy_by_environment():
    assert isal.load({"TIERCKPT_NO_ISAL": "1"}) is None


@needs_isal
def test_matrix_and_inverse_identical_to_isal():
    for k, m in [(1, 2), (4, 2), (10, 4), (29, 3), (2, 30)]:
        ours = gf.cauchy_matrix(k, m)
        assert np.array_equal(ours, ISAL.cauchy_matrix(k, m)), (k, m)
        rng = np.random.default_rng(k * 100 + m)
        rows = sorted(rng.choice(k + m, size=k, replace=False).tolist())
        sub = ours[rows]
        assert np.array_equal(gf.invert(sub), ISAL.invert(sub))
        assert np.array_equal(gf.matmul(sub, gf.invert(sub)), np.eye(k, dtype=np.uint8))


@needs_isal
@pytest.mark.parametrize("n", [0, 1, 15, 31, 32, 33, 63, 64, 1000, 65537, (1 << 20) + 7])
def test_encode_identical_bytes_isal_and_numpy(n):
    k, m = 4, 2
    data = _blocks(k, n, seed=n)
    a = rs.Codec(k, m, ISAL).encode(data)
    b = rs.Codec(k, m, gf.NumpyBackend()).encode(data)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("impl", ["numpy", pytest.param("isal", marks=needs_isal)])
def test_incremental_update_equals_encode_in_any_order(impl):
    be = ISAL if impl == "isal" else gf.NumpyBackend()
    k, m, n = 5, 3, 4099
    c = rs.Codec(k, m, be)
    data = _blocks(k, n, seed=3)
    full = c.encode(data)
    # one holder per row, data arriving in a different order at each, some blocks shorter (zero-padded)
    for row in range(m):
        par = bytearray(n)
        for i in reversed(range(k)) if row % 2 else range(k):
            c.update([row], [par], i, data[i])
        assert bytes(par) == full[row].tobytes()
    short = [d.copy() for d in data]
    short[2][100:] = 0
    par = bytearray(n)
    for i in range(k):
        c.update([0], [par], i, short[i][:100] if i == 2 else short[i])
    assert bytes(par) == c.encode(short)[0].tobytes()


@pytest.mark.parametrize("impl", ["numpy", pytest.param("isal", marks=needs_isal)])
@pytest.mark.parametrize("k,m", [(4, 2), (3, 3), (2, 1)])
def test_any_k_of_k_plus_m_decodes_every_block(impl, k, m):
    be = ISAL if impl == "isal" else gf.NumpyBackend()
    c = rs.Codec(k, m, be)
    data = _blocks(k, 777, seed=k + m)
    blocks = data + c.encode(data)
    for keep in itertools.combinations(range(k + m), k):
        got = c.decode({i: blocks[i] for i in keep}, range(k + m))
        assert all(np.array_equal(got[i], blocks[i]) for i in range(k + m)), keep


def test_decode_refuses_too_few_and_out_of_range():
    c = rs.Codec(4, 2, gf.NumpyBackend())
    data = _blocks(4, 10)
    with pytest.raises(ValueError, match="present"):
        c.decode({0: data[0], 1: data[1], 2: data[2]}, [3])
    with pytest.raises(ValueError, match="block"):
        c.decode({0: data[0], 1: data[1], 2: data[2], 9: data[3]}, [3])
    with pytest.raises(ValueError, match="one length"):
        c.decode({0: data[0], 1: data[1], 2: data[2], 3: data[3][:5]}, [4])
    with pytest.raises(ValueError, match="row"):
        c.update([2], [bytearray(10)], 0, data[0])
    with pytest.raises(ValueError, match="index"):
        c.update([0], [bytearray(10)], 4, data[0])
    with pytest.raises(ValueError, match="K \\+ M <= 32"):
        rs.Codec(30, 3)


def test_solve_uses_only_rows_holding_every_unknown():
    from tierckpt.errors import UnavailableError
    from tierckptd.parity.rsdecode import solve

    c = rs.Codec(4, 2, gf.NumpyBackend())
    data = _blocks(4, 500, seed=9)
    data[3] = data[3][:300]  # a shorter member: zero-padded in the rows
    rows = {0: bytearray(500), 1: bytearray(500)}
    for i in range(4):
        c.update([0], [rows[0]], i, data[i])
    for i in range(3):  # row 1 has not received member 3 yet
        c.update([1], [rows[1]], i, data[i])
    held = {0: (rows[0], {0, 1, 2, 3}), 1: (rows[1], {0, 1, 2})}
    # one unknown: row 1 alone (it lacks member 3, which is known and subtracted only where held)
    assert np.array_equal(solve(c, 1, {0: data[0], 2: data[2], 3: data[3]}, [1], {1: held[1]}, 500), data[1])
    # two unknowns, both rows hold both
    assert np.array_equal(solve(c, 1, {0: data[0], 3: data[3]}, [1, 2], held, 500), data[1])
    # two unknowns, one of them missing from row 1: not determined
    with pytest.raises(UnavailableError, match="only 1 parity rows"):
        solve(c, 1, {0: data[0], 2: data[2]}, [1, 3], held, 500)
    # a shorter target: its own length
    assert np.array_equal(solve(c, 3, {0: data[0], 1: data[1], 2: data[2]}, [3], {0: held[0]}, 300), data[3])
