"""trainer.max_minutes and trainer.train_until: the horizon is cut once, at the end of the warm-up,
to what fits the nearer limit at the rate of the first steps; the schedule and the progress bar
follow the cut, a checkpoint keeps it."""

import pytest
import torch

from train.loop import Horizon, Progress, make_optimizer


class Clock:
    """A clock that advances `per_step` seconds each time the loop body ends a step (tick)."""

    def __init__(self, first: float, per_step: float):
        self.now, self.first, self.per_step, self.ticks = 0.0, first, per_step, 0

    def __call__(self) -> float:
        return self.now

    def tick(self) -> None:
        self.now += self.first if self.ticks == 0 else self.per_step
        self.ticks += 1


def run(horizon: Horizon, clock: Clock, start: int = 0) -> list[int]:
    steps = []
    for step in horizon.steps_from(start):
        steps.append(step)
        clock.tick()
    return steps


def test_the_steps_that_do_not_fit_are_cut_at_the_decision_step():
    # First step 30 s (warm-up work), then 2 s a step; 5 minutes: after 10 steps 48 s are spent,
    # 252 s are left, 126 more steps fit.
    clock, said = Clock(30.0, 2.0), []
    horizon = Horizon(1000, max_minutes=5, decide_at=10, print_line=said.append, clock=clock)
    assert run(horizon, clock) == list(range(136))
    assert horizon.steps == 136 and horizon.state() == {"max_steps": 1000, "steps": 136}
    assert len(said) == 1 and "1000 steps would take ~33.8 min at 2.00 s a step" in said[0]
    assert "training 136 steps" in said[0]


def test_steps_that_fit_are_kept_and_no_limit_reads_no_clock():
    clock, said = Clock(1.0, 1.0), []
    horizon = Horizon(50, max_minutes=5, decide_at=10, print_line=said.append, clock=clock)
    assert run(horizon, clock) == list(range(50)) and said == ["trainer.max_minutes=5: 50 steps fit (~0.8 min)"]
    unlimited = Horizon(50, clock=lambda: pytest.fail("read the clock"), print_line=pytest.fail)
    assert run(unlimited, Clock(1.0, 1.0)) == list(range(50))


def test_a_budget_already_spent_stops_at_the_decision_step_and_processes_agree():
    clock = Clock(100.0, 1.0)
    asked = []
    horizon = Horizon(
        40, max_minutes=1, decide_at=5, print_line=lambda s: None, clock=clock, agree=lambda n: asked.append(n) or 7
    )
    assert run(horizon, clock) == list(range(7))  # rank 0's decision (7) wins over this process's own (5)
    assert asked == [5]


def test_a_deadline_counts_the_time_before_the_loop_and_the_nearer_limit_wins():
    """train_until is a whole job's deadline (a Unix time): the time spent before the loop (data)
    counts, where max_minutes counts from the loop's start. With both, the nearer one cuts."""
    wall = lambda: 1_000_000.0  # noqa: E731  (the Unix time when the horizon is made)
    # The same budget as max_minutes=5 above when the loop starts at once: 136 steps.
    clock, said = Clock(30.0, 2.0), []
    horizon = Horizon(1000, decide_at=10, until=wall() + 300, print_line=said.append, clock=clock, wall=wall)
    assert run(horizon, clock) == list(range(136))
    assert said == [
        "trainer.train_until (4.2 min left): 1000 steps would take ~33.8 min at 2.00 s a step here; "
        "training 136 steps (the schedule ends there)"
    ]
    # 100 s of data before the loop: 154 s left at the decision, 77 more steps; max_minutes=5 alone
    # would give 136, so the deadline cuts.
    clock, said = Clock(30.0, 2.0), []
    horizon = Horizon(
        1000, max_minutes=5, decide_at=10, until=wall() + 300, print_line=said.append, clock=clock, wall=wall
    )
    clock.now += 100
    assert run(horizon, clock) == list(range(86)) and said[0].startswith("trainer.train_until (2.6 min left)")
    # A far deadline: max_minutes cuts, and says so as before.
    clock, said = Clock(30.0, 2.0), []
    horizon = Horizon(
        1000, max_minutes=5, decide_at=10, until=wall() + 3600, print_line=said.append, clock=clock, wall=wall
    )
    assert run(horizon, clock) == list(range(136)) and said[0].startswith("trainer.max_minutes=5: 1000 steps")
    # A deadline already past: the warm-up's steps and one more, as for a spent max_minutes.
    clock, said = Clock(30.0, 2.0), []
    horizon = Horizon(1000, decide_at=10, until=wall() - 60, print_line=said.append, clock=clock, wall=wall)
    assert run(horizon, clock) == list(range(10)) and said[0].startswith("trainer.train_until (0.0 min left)")
    # Steps that fit: said, nothing cut.
    clock, said = Clock(1.0, 1.0), []
    horizon = Horizon(50, decide_at=10, until=wall() + 609, print_line=said.append, clock=clock, wall=wall)
    assert run(horizon, clock) == list(range(50))
    assert said == ["trainer.train_until (10.0 min left): 50 steps fit (~0.8 min)"]
    for bad in (True, "5", -3, 0):  # check_trainer refuses these before a run starts, in the same words
        with pytest.raises(ValueError, match=f"train_until={bad}: give a Unix time in seconds"):
            Horizon(10, until=bad)


def test_a_checkpoint_keeps_the_cut_unless_max_steps_changed():
    clock = Clock(30.0, 2.0)
    first = Horizon(1000, max_minutes=5, decide_at=10, print_line=lambda s: None, clock=clock)
    run(first, clock)
    saved = first.state()
    again = Horizon(1000, max_minutes=5, decide_at=10, print_line=pytest.fail, clock=clock)
    again.restore(saved)
    assert again.steps == 136 and run(again, clock, start=100) == list(range(100, 136))  # no second decision
    more = Horizon(2000, max_minutes=5, decide_at=10, print_line=pytest.fail, clock=clock)
    more.restore(saved)
    assert more.steps == 2000
    with pytest.raises(ValueError, match="max_minutes=0: give a positive number"):
        Horizon(10, max_minutes=0)
    for bad in (True, "5", -1.5):  # what check_trainer refuses before a run starts, the same words
        with pytest.raises(ValueError, match=f"max_minutes={bad}: give a positive number"):
            Horizon(10, max_minutes=bad)


def test_the_schedule_and_the_progress_bar_follow_the_cut():
    """Past the cut the learning rate is the schedule of a run configured with the cut's steps;
    before it (the warm-up) every step's rate is the same either way."""
    clock = Clock(30.0, 2.0)
    horizon = Horizon(1000, max_minutes=5, decide_at=10, print_line=lambda s: None, clock=clock)
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer, scheduler = make_optimizer([param], lr=0.1, weight_decay=0.0, warmup_steps=10, max_steps=horizon)
    other, reference = make_optimizer([param], lr=0.1, weight_decay=0.0, warmup_steps=10, max_steps=136)
    progress = Progress(None, start=0, total=horizon, log_every=1000, desc="t", postfix=(), show=False)
    lrs, expected = [], []
    for step in horizon.steps_from(0):
        lrs.append(scheduler.get_last_lr()[0])
        expected.append(reference.get_last_lr()[0])
        optimizer.step(), other.step()  # no gradient: only the schedules move
        scheduler.step(), reference.step()
        clock.tick()
        if step + 1 < 136:  # Progress logs at its total: the last step would log
            progress.update(step + 1, {})
    assert lrs == expected and len(lrs) == 136 and lrs[-1] < lrs[20]
    assert progress.total == 136 and progress.bar.total == 136
