"""The study's console: with runs queued behind workers, only the running runs have bars beside the study's."""

from __future__ import annotations

from types import SimpleNamespace

from k3compile.ablation.progress import display
from k3compile.ablation.study import RunKey


def test_only_running_runs_show_and_late_ticks_are_ignored():
    keys = [RunKey(v, "lm", 0) for v in ("base", "a", "b", "c")]
    study = SimpleNamespace(steps={"base": 4, "a": 4, "b": 4, "c": 4})
    done = {keys[3].id: {}}  # finished in an earlier session
    with display(True, study, keys, done) as show:
        assert show.running() == []
        show.tick(keys[0], 0)
        show.tick(keys[1], 2)  # a resumed run's first tick is where it resumes
        assert show.running() == [keys[0].id, keys[1].id]
        show.finish(keys[0], {"task": "lm", "final": 1.0, "best": 1.0})
        show.tick(keys[0], 4)  # a finished worker's tick drained late
        show.tick(keys[3], 1)  # and a run finished before this session
        assert show.running() == [keys[1].id]
        show.tick(keys[2], 0)
        assert show.running() == [keys[1].id, keys[2].id]
