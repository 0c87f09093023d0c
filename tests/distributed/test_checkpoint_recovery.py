"""A checkpoint every rank has written is not lost when the run ends badly.

- Rank 0's rollout fails with a background checkpoint unpublished: every rank raises the same RolloutFailed
  and the checkpoint is published first (a 2-process `train` run, tests/distributed/workers/rollout_fails.py).
- A kill leaves a `.tmp` behind: the next start publishes it when it is complete (the worker starts the run
  again on one) and removes it when not (`recover_unpublished`, on copies of that run's real checkpoint
  folders, broken on purpose).
"""
import shutil
from pathlib import Path

import pytest

from devtools.torchrun import run_checks
from megatron_gspo.dev.tiny_model import TinyQwen3Spec, make_tiny_qwen3
from megatron_gspo.training.checkpoint import LATEST, complete_iterations, find_latest, recover_unpublished

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "rollout_fails.py"


@pytest.fixture(scope="module")
def failed_run(tmp_path_factory) -> Path:
    """The checkpoint folder of a run whose rollout failed on rank 0 at step 3: iter_0000001, iter_0000002."""
    workdir = tmp_path_factory.mktemp("rollout_fails")
    hf_dir = make_tiny_qwen3(workdir / "hf", TinyQwen3Spec(num_experts=4))
    run_checks(WORKER, 2, workdir, hf_dir, checks=3, timeout=300)
    return workdir / "run" / "ckpt"


def test_a_rollout_failure_on_rank_0_publishes_the_background_checkpoint_on_every_rank(failed_run):
    assert complete_iterations(failed_run) == [1, 2] and find_latest(failed_run) == 2  # (the worker's checks)


@pytest.fixture
def killed_before_publishing(failed_run, tmp_path) -> Path:
    """The folder as a kill between Megatron's finalize (.metadata written, every rank's tensors with it)
    and the publication of step 2 leaves it: iter_0000002.tmp, the `latest` file still at 1. The
    publication is a rename and the `latest` file, so undoing them gives exactly that folder."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(failed_run, ckpt)
    (ckpt / "iter_0000002").rename(ckpt / "iter_0000002.tmp")
    (ckpt / LATEST).write_text("1\n")
    assert find_latest(ckpt) == 1
    return ckpt


def test_a_complete_unpublished_checkpoint_is_published_at_the_next_start(killed_before_publishing):
    ckpt = killed_before_publishing
    assert recover_unpublished(ckpt, keep_last=1) == ["published iter_0000002 left complete by the previous run"]
    assert complete_iterations(ckpt) == [2] and find_latest(ckpt) == 2  # keep_last=1 pruned step 1, as a save does
    assert (ckpt / LATEST).read_text() == "2\n" and not list(ckpt.glob("*.tmp"))
    assert recover_unpublished(ckpt) == []  # nothing left to do


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _first_distcp(tmp: Path) -> Path:
    return sorted(tmp.glob("*.distcp"))[0]


# name: (how the folder is broken, what the removal line says after "incomplete (")
BREAKAGES = {
    "no_metadata": (lambda tmp: (tmp / ".metadata").unlink(),
                    "no .metadata: the previous run died while writing it)"),
    "truncated_metadata": (lambda tmp: _truncate(tmp / ".metadata"), "/.metadata: truncated or corrupt"),
    "missing_distcp": (lambda tmp: _first_distcp(tmp).unlink(), ".distcp: missing (the checkpoint's .metadata has"),
    "truncated_distcp": (lambda tmp: _truncate(_first_distcp(tmp)), ".distcp: truncated torch_dist data file"),
    "no_metadata_json": (lambda tmp: (tmp / "metadata.json").unlink(), "no metadata.json)"),
    "no_common_pt": (lambda tmp: (tmp / "common.pt").unlink(), "no common.pt)"),
    "truncated_trainer_pt": (lambda tmp: _truncate(tmp / "trainer.pt"), "trainer.pt cannot be read"),
    "no_rng_of_rank_1": (lambda tmp: (tmp / "rng" / "rank_00001.pt").unlink(),
                         "no rng/rank_00001.pt (saved by 2 ranks))"),
}


@pytest.mark.parametrize("breakage", BREAKAGES)
def test_an_incomplete_unpublished_checkpoint_is_removed_at_the_next_start(killed_before_publishing, breakage):
    ckpt = killed_before_publishing
    tmp = ckpt / "iter_0000002.tmp"
    breaks, says = BREAKAGES[breakage]
    breaks(tmp)
    [line] = recover_unpublished(ckpt)
    assert line.startswith("removed iter_0000002.tmp: incomplete (") and says in line, line
    assert not tmp.exists() and complete_iterations(ckpt) == [1] and find_latest(ckpt) == 1


def test_a_tmp_older_than_the_latest_checkpoint_is_left_for_the_next_save(failed_run, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(failed_run, ckpt)
    (ckpt / "iter_0000001").rename(ckpt / "iter_0000001.tmp")   # older than the latest (2): not resumed from
    assert recover_unpublished(ckpt) == []
    assert (ckpt / "iter_0000001.tmp").is_dir() and find_latest(ckpt) == 2
    assert recover_unpublished(tmp_path / "missing") == []
