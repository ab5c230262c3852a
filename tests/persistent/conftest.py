"""The tests of this directory written against the per-shard layout run with it (they inspect and
break its objects); tests of the content layout opt out with the ``content_layout`` marker."""

from collections.abc import Iterator

import pytest
from tierckptd.knobs import KNOBS


@pytest.fixture(autouse=True)
def _layout(request: pytest.FixtureRequest) -> Iterator[None]:
    per_shard = 0 if request.node.get_closest_marker("content_layout") else 1
    with KNOBS.overridden(per_shard_layout=per_shard):
        yield


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "content_layout: run with the content layout (the default of daemons)")
