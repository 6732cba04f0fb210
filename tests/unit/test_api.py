"""`from hpc import submit` is callable however the process imported the toolkit before: the
hpc.submit package (which Python hands out for that name once any of its modules is imported)
is itself the function (a test that ran first imported hpc.submit.slurm: CI saw the package)."""

from __future__ import annotations

import pytest


def test_submit_is_the_api_even_after_the_submit_package_was_imported(tmp_path):
    import hpc.submit.slurm  # noqa: F401 - what any launcher-side import does first
    from hpc import submit
    from hpc.submit import SubmitError

    with pytest.raises(SubmitError, match=r"^unknown key 'optim.lrr'; valid keys in 'optim': name, lr"):
        submit("optim.lrr=0.1", cwd=tmp_path)
    assert not list(tmp_path.iterdir())  # refused: nothing left behind
