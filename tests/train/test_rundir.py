"""check_unclaimed: a --resume names the run that holds the directory before reading its files."""
import os

import pytest

from shardmoe.train.rundir import check_unclaimed, claim_run_dir


def test_check_unclaimed_names_the_holder_and_passes_once_released(tmp_path):
    out = tmp_path / "run"
    check_unclaimed(out)  # no directory yet: nothing to refuse
    lock = claim_run_dir(out, resume=False, overwrite=False)
    with pytest.raises(ValueError, match=rf"--out {out}: another run \(pid {os.getpid()}\) is writing"):
        check_unclaimed(out)
    lock.release()
    check_unclaimed(out)  # the lock file stays, the lock does not
