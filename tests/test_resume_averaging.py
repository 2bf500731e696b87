"""A resume with other averaging hyperparameters than its checkpoint's goes on, and says
so on rank 0: the setting, the checkpoint's value and the new one."""

from dataclasses import replace

import pytest

from hpctrain.checkpoint.training import averaging_changes
from hpctrain.config import Config
from hpctrain.testing import run_train, tiny_corpus_config, tiny_gpt_template


def meta(strategy: str, every: int, sync_steps: int = 0, **parallel) -> dict:
    """A checkpoint's metadata as ``save_training`` writes it (averaging and config)."""
    config = Config().to_dict()
    config["parallel"] |= {"averaging": strategy, "average_every": every,
                           "sync_steps": sync_steps, **parallel}
    return {"config": config, "averaging": {"strategy": strategy, "every": every,
                                            "sync_steps": sync_steps, "dp": 2, "t": 4,
                                            "weighted": False}}


def run_with(strategy: str, **parallel) -> Config:
    cfg = Config()
    return replace(cfg, parallel=replace(cfg.parallel, averaging=strategy, **parallel))


@pytest.mark.parametrize("saved, cfg, changes", [
    (meta("diloco", 2), run_with("diloco", average_every=5, outer_lr=0.3),
     [("average_every", 2, 5), ("outer_lr", 0.7, 0.3)]),
    (meta("diloco", 2, outer_momentum=0.5), run_with("diloco", average_every=2),
     [("outer_momentum", 0.5, 0.9)]),
    # outer_lr means nothing to periodic averaging: no warning for it
    (meta("periodic", 4), run_with("periodic", average_every=4, outer_lr=0.1), []),
    (meta("post_local", 4, 10), run_with("post_local", average_every=4, sync_steps=3),
     [("sync_steps", 10, 3)]),
    (meta("hierarchical", 8), run_with("hierarchical", average_every=2),
     [("average_every", 8, 2)]),
    ({"config": Config().to_dict()}, run_with("sync"), []),  # synchronous: no averaging
])
def test_the_changed_averaging_settings_are_named(saved, cfg, changes):
    assert averaging_changes(saved, cfg) == changes


CONFIG = tiny_gpt_template(train="steps = 4\nbatch_size = 12\nsave_interval = 4")


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    return tiny_corpus_config(tmp_path_factory.mktemp("resume_averaging"), CONFIG,
                              "now is the winter of our discontent.", 300)


def test_a_diloco_resume_with_other_settings_warns_on_rank_0(config_file, tmp_path):
    run_dir = tmp_path / "run"
    first = run_train(2, config_file, run_dir, "--averaging", "diloco", "--average-every", "2",
                      timeout=120)
    assert first.returncode == 0, first.stderr
    changed = run_train(2, config_file, run_dir, "--averaging", "diloco", "--average-every",
                        "5", "--outer-lr", "0.3", "--steps", "8", "--resume", "auto",
                        timeout=120)
    assert changed.returncode == 0, changed.stderr
    lines = [line for line in changed.stdout.splitlines() if line.startswith("warning: ")]
    assert "warning: average_every 5 where the checkpoint's run had 2 (averaging 'diloco'): " \
        "the new value applies from step 5" in lines, changed.stdout
    assert "warning: outer_lr 0.3 where the checkpoint's run had 0.7 (averaging 'diloco'): " \
        "the new value applies from step 5" in lines, changed.stdout
    assert sum("outer_lr" in line for line in lines) == 1  # rank 0 alone
    # the same settings as saved: no such warning
    same = run_train(2, config_file, run_dir, "--averaging", "diloco", "--average-every", "5",
                     "--outer-lr", "0.3", "--steps", "10", "--resume", "auto", timeout=120)
    assert same.returncode == 0, same.stderr
    assert "where the checkpoint's run had" not in same.stdout, same.stdout
