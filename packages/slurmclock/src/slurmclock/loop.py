"""The time-aware training loop, for any trainer: when to stop, to save, to save once more, to exit.

One :class:`TimeLoop` per process, asked at every optimizer-step boundary. It is the protocol
that pyrecover-train, the Lightning and Hugging Face callbacks, an own loop and the simulator
all follow, written once:

* **stop** -- rank 0 asks the :class:`~slurmclock.TimeBudget` (the deadline, the measured step,
  save and exit times); every rank adds its stop signals; one agreement per step (``agree``,
  injected: element-wise max over the ranks) stops every rank at the same step, with one final
  save that the caller makes durable.
* **periodic saves** -- a save the caller's schedule says is due starts only if the budget says
  it can end in time (agreed in the same collective). ``probe_saves``: when no save time is
  known, one save right after the warm-up measures it, instead of a guess standing in.
* **extra saves** -- after a stop for time the final save's tail bound usually leaves time
  unused: rank 0 plans to train on and save again (shared through ``share``), and such a save
  not durable when the exit must begin is abandoned -- a watchdog thread marks the job's
  timeline and ends the process with 75. That is as harmless as a SIGKILL mid-save when the save
  is atomic (ckptstore, Lightning's ``CheckpointIO``, a Trainer's ``checkpoint-N`` folder found
  by ``slurmclock.hf.last_checkpoint``): the last durable checkpoint stands.
* **exit codes** -- :data:`EXIT_STOPPED` (75: stopped with a checkpoint, requeue) and
  :data:`EXIT_FINISHED` (0); :func:`end_process` exits without the interpreter's teardown.
* **the job's timeline** -- ``first_step`` once the first step is done (the start-up a restart
  in the allocation costs), ``checkpoint step=N`` for every durable save, ``saved`` once the
  stop's checkpoint (or an extra one) is durable: the next allocation measures the exit from it.

Stdlib only: ranks agree through the callables given (ddpkit's ``Dist.agree`` and
``broadcast_object``, a torch all-reduce); one process needs none. Per step it costs the budget's
``should_stop()`` (microseconds) and one agreement.

    loop = TimeLoop(TimeBudget(DeadlineWatcher(), timeline=JobTimeline()))
    loop.begin()                       # installs the stop signals (USR2, TERM)
    while loop.training:
        train_step()
        step += 1
        act = loop.after_step(step, save_due=step % 100 == 0, last=step == total)
        if act.save:
            with loop.saving(act):     # an extra save: abandoned if not durable in time
                seconds = save(step, blocking=act.durable)
                loop.saved(step, seconds)  # async: call it later, once durable
    loop.end()
    end_process(loop.exit_code)        # 75: requeue me; 0: done
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, NoReturn

from slurmclock.allocation import allocation_start
from slurmclock.budget import Decision, ExtraSave, TimeBudget
from slurmclock.deadline import Deadline, DeadlineWatcher, process_start_time
from slurmclock.job import EXIT_FINISHED, EXIT_STOPPED, job_id, num_nodes
from slurmclock.signals import STOP_SIGNALS, AnyFlag, StopFlag, StopSignals, signal_number
from slurmclock.timeline import JobTimeline

__all__ = [
    "EXIT_FINISHED",
    "EXIT_STOPPED",
    "Action",
    "TimeAware",
    "TimeLoop",
    "end_process",
    "measured_launch",
]

log = logging.getLogger("slurmclock")

# Codes of the per-step agreement (element-wise max over the ranks: the strongest wins).
_GO, _TIME, _SIGNAL = 0, 1, 2
_CAUSES = {_TIME: "time", _SIGNAL: "signal"}


@dataclass(frozen=True, slots=True)
class Action:
    """What to do at this step boundary.

    ``save``: None, ``"periodic"`` (the caller's own kind of save: async is fine), ``"final"``
    (the stop's, or the last step's) or ``"extra"``; the last two must be durable before the
    ``with loop.saving(act):`` block ends (``durable``). ``reason``: why, in words.
    """

    save: str | None = None
    reason: str = ""

    @property
    def durable(self) -> bool:
        return self.save in ("final", "extra")


class TimeLoop:
    """The time-aware loop protocol of one process; see the module docstring.

    ``budget``: a ready :class:`TimeBudget`, or None for ``TimeBudget(deadline or
    DeadlineWatcher(), timeline=JobTimeline(), **budget_kw)``. ``signals``: a stop flag the
    caller installed (any :class:`~slurmclock.StopFlag`), or signal names for a
    :class:`StopSignals` this loop installs in :meth:`begin` (default :data:`STOP_SIGNALS`;
    the budget's own flag when it has one). ``leader``: this rank decides (rank 0); ``agree``:
    ``agree(*ints) -> tuple`` of the element-wise max over all ranks (default: one process);
    ``share``: rank 0's object on every rank. ``extra_saves``: plan saves after the final one.
    ``probe_saves``: ask for one save after the warm-up while no save time is known.
    ``background_saves``: periodic saves are written while training goes on (async).
    ``on_abandon(message)``: called on the watchdog thread before the process exits 75.
    ``launch``: seconds from the allocation's start to this process's start (None: measured by
    :func:`measured_launch` after the warm-up, rank 0); the first allocation's exit guess, in a
    job on one node.
    ``timer`` times steps when ``after_step`` is not given their seconds (default: the
    budget's). ``exit`` ends the process after an abandon (``os._exit``); ``watchdog=False``: no
    abandon thread (a simulation decides abandons itself from :attr:`plan`).

    Args:
        budget: A ready :class:`TimeBudget`, or None to build one from ``deadline`` and
            ``budget_kw``.
        deadline: The deadline of the budget built here (default ``DeadlineWatcher()``).
        signals: A stop flag the caller installed, or signal names this loop installs in
            :meth:`begin` (default :data:`STOP_SIGNALS`).
        leader: This rank decides (rank 0).
        agree: ``agree(*ints) -> tuple``: the element-wise max over all ranks (default: one
            process).
        share: Rank 0's object on every rank (default: one process).
        extra_saves: Plan saves after the final one while time is left.
        probe_saves: Ask for one save after the warm-up while no save time is known.
        background_saves: Periodic saves are written while training goes on (async).
        on_abandon: ``on_abandon(message)``, called on the watchdog thread before the process
            exits 75.
        launch: Seconds from the allocation's start to this process's start, a callable
            giving them, or None (measured after the warm-up).
        timer: Times steps when ``after_step`` is not given their seconds.
        exit: Ends the process after an abandon (default ``os._exit``).
        watchdog: Run the abandon thread (False: the caller decides abandons from
            :attr:`plan`).
        **budget_kw: :class:`TimeBudget` keywords for the budget built here.
    """

    def __init__(
        self,
        budget: TimeBudget | None = None,
        *,
        deadline: DeadlineWatcher | Deadline | None = None,
        signals: StopFlag | Iterable[str | int] | None = None,
        leader: bool = True,
        agree: Callable[..., tuple[int, ...]] | None = None,
        share: Callable[[Any], Any] | None = None,
        extra_saves: bool = True,
        probe_saves: bool = False,
        background_saves: bool = False,
        on_abandon: Callable[[str], None] | None = None,
        launch: float | Callable[[], float | None] | None = None,
        timer: Callable[[], float] | None = None,
        exit: Callable[[int], None] = os._exit,
        watchdog: bool = True,
        **budget_kw: Any,
    ) -> None:
        flag, self._owned = self._flag(signals, budget)
        if budget is None:
            budget = TimeBudget(
                DeadlineWatcher() if deadline is None else deadline,
                signals=flag,
                timeline=JobTimeline(),
                **budget_kw,
            )
        elif budget_kw or deadline is not None:
            raise TypeError("pass either a ready budget or its settings, not both")
        elif budget.signals is None:
            budget.signals = flag
        self.budget = budget
        self.leader, self.extra_saves, self.probe_saves = leader, extra_saves, probe_saves
        self.background_saves, self.on_abandon = background_saves, on_abandon
        self._agree = agree or (lambda *values: tuple(values))
        self._share: Callable[[Any], Any] = share or (lambda obj: obj)
        self._launch, self._launch_asked = launch, False
        self._timer = budget.timer if timer is None else timer
        self._exit, self._watchdog = exit, watchdog
        self._last: float | None = None
        self._phase = "train"  # -> final -> (extra <-> extra save) -> exit
        self._issued: dict[int, str] = {}  # step -> kind of the save asked for at that step
        self._plan: ExtraSave | None = None
        self.durable_step: int | None = None  # the newest checkpoint known to be durable
        self._save_step = -1  # the step of the final or extra save asked for last
        self._probed = self._first_marked = self.finished = False
        self.cause: str | None = None  # "time" or "signal" once stopping
        self.reason = ""
        self.decision: Decision | None = None  # rank 0's last answer
        self.abandoned: str | None = None

    @staticmethod
    def _flag(
        signals: StopFlag | Iterable[str | int] | None, budget: TimeBudget | None
    ) -> tuple[StopFlag | None, StopSignals | None]:
        """(the flag the budget reads, the StopSignals this loop installs itself, if any)."""
        if isinstance(signals, StopFlag):
            return signals, None
        mine = None if budget is None else budget.signals
        if signals is None and mine is not None:
            return mine, None
        owned = StopSignals(tuple(signals or ()) or STOP_SIGNALS, chain=False)
        if mine is not None:  # the budget's flag and the loop's own, read as one
            budget.signals = AnyFlag(mine, owned)  # type: ignore[union-attr]
        return owned, owned

    # -- around the loop -------------------------------------------------------------------

    def connect(
        self,
        *,
        leader: bool,
        agree: Callable[..., tuple[int, ...]] | None,
        share: Callable[[Any], Any] | None,
    ) -> None:
        """The ranks, once a trainer knows them (before :meth:`begin`): see the class."""
        self.leader = leader
        self._agree = agree or (lambda *values: tuple(values))
        self._share = share or (lambda obj: obj)

    def add_signal(self, sig: str | int) -> None:
        """Also stop on ``sig`` (e.g. Lightning's requeue signal, taken over); before begin()."""
        if self._owned is None:
            raise RuntimeError("add_signal() needs the loop's own signals (signals= names)")
        number = signal_number(sig)
        if number not in self._owned.signals:
            self._owned.signals = (*self._owned.signals, number)

    def request_stop(self, reason: str = "manual") -> None:
        """Raise the stop flag by hand, as a stop signal would (e.g. a callback's own reason)."""
        flag = self._owned or self.budget.signals
        if not isinstance(flag, (StopSignals, AnyFlag)):
            raise TypeError(f"request_stop() raises a StopSignals or AnyFlag, not {flag!r}")
        flag.request(reason)

    def begin(self) -> None:
        """Training starts: the loop's own stop signals are installed, the step timer runs."""
        if self._owned is not None:
            self._owned.install()
        self._last = self._timer()

    def end(self) -> None:
        """Training is over (or failed): the loop's own signal handlers are put back."""
        if self._owned is not None:
            self._owned.restore()

    def paused(self) -> None:
        """What ran since the last step boundary was not training (an evaluation, a save)."""
        self._last = self._timer()

    @property
    def training(self) -> bool:
        """False once the loop is over: leave it (and exit with :attr:`exit_code`)."""
        return self._phase != "exit"

    @property
    def stopped_early(self) -> bool:
        return self.cause is not None and not self.finished

    @property
    def exit_code(self) -> int:
        """75 after a stop with steps left, else 0."""
        return EXIT_STOPPED if self.stopped_early else EXIT_FINISHED

    @property
    def plan(self) -> ExtraSave | None:
        """The extra save being trained for (every rank has rank 0's)."""
        return self._plan

    # -- at every step boundary ------------------------------------------------------------

    def after_step(
        self,
        step: int,
        *,
        save_due: bool = False,
        last: bool = False,
        seconds: float | None = None,
    ) -> Action:
        """Step ``step`` is done: record it (``seconds``, else the time since the last
        boundary) and say what to do. ``save_due``: the caller's schedule wants a periodic save;
        ``last``: the steps are done (the same on every rank: no agreement needed)."""
        now = self._timer()
        if seconds is None and self._last is not None:
            seconds = now - self._last
        self._last = now
        if seconds is not None:
            self.budget.record_step(seconds)
        if not self._first_marked:
            self._mark_first_step(step, seconds)
        if self._phase == "train":
            return self._train_boundary(step, save_due, last)
        if self._phase == "extra":
            return self._extra_boundary(step, last)
        if self._phase == "exit":
            raise RuntimeError("after_step() after the loop ended: leave it when not training")
        raise RuntimeError(
            f"after_step() with the {self._phase} pending: make it in `with loop.saving(act):`"
        )

    def _mark_first_step(self, step: int, seconds: float | None) -> None:
        """The job's timeline: this process's first step is done. From its launch to here is
        the start-up a restart costs (``slurmclock supervise`` weighs it against the time
        left before it starts a failed step again in the allocation)."""
        self._first_marked = True
        timeline = self.budget.timeline
        if timeline is not None and self.leader:
            info = {} if seconds is None else {"seconds": round(seconds, 3)}
            timeline.mark("first_step", step=int(step), **info)

    def _train_boundary(self, step: int, save_due: bool, last: bool) -> Action:
        if last:
            self.finished, self.reason = True, "the steps are done"
            return self._ask(step, "final", self.reason)
        code, due, cannot = _GO, save_due, False
        if self.leader:
            self._measure_launch()
            d = self.decision = self.budget.should_stop()
            code = (_SIGNAL if d.cause == "signal" else _TIME) if d.stop else _GO
            due = due or self._probe_due()
            cannot = due and code == _GO and not self._can_save()
        elif self.budget.stop_signal() is not None:
            code = _SIGNAL
        code, due_i, cannot_i = self._agree(code, int(due), int(cannot))
        if code:
            self.cause = _CAUSES[code]
            mine = self.decision if self.leader else None
            self.reason = mine.reason if mine and mine.stop else "another rank asked to stop"
            return self._ask(step, "final", self.reason)
        if due_i and cannot_i:
            why = self._can_save().reason
            log.info("step %d: periodic save skipped: %s", step, why)
            return Action(None, f"periodic save skipped: {why}")
        return self._ask(step, "periodic", "due") if due_i else Action()

    def _extra_boundary(self, step: int, last: bool) -> Action:
        plan = self._plan
        assert plan is not None
        if last:
            self.finished, self.reason = True, "the steps are done"
            return self._ask(step, "extra", self.reason)
        signal = self.budget.stop_signal()
        fits = not self.leader or plan.step_fits(self.budget.now(), self.budget.step_estimate or 0)
        code = _SIGNAL if signal else _GO if fits else _TIME
        code = self._agree(code, 0, 0)[0]  # the shape of every step's agreement
        if code == _SIGNAL:  # the exit, now: the last durable save stands (still a stop for time)
            self._phase = "exit"
            self.reason = f"{self.reason}; then stop: received {signal or 'a stop signal'}"
            return Action(None, self.reason)
        if code == _TIME:
            return self._ask(step, "extra", "no further step fits the extra save's plan")
        return Action()

    def _ask(self, step: int, kind: str, reason: str) -> Action:
        self._issued[step] = kind
        if kind != "periodic":
            self._phase, self._save_step = ("final" if kind == "final" else "extra save"), step
        return Action(kind, reason)

    def _can_save(self) -> Decision:
        return self.budget.can_save(background=self.background_saves)

    def _probe_due(self) -> bool:
        """Once, after the warm-up, while no save time is known (here or from an earlier
        allocation) and there is a deadline: measure a save instead of trusting a guess."""
        b = self.budget
        if not self.probe_saves or self._probed or b.has_save_estimate:
            return False
        if b.steps_measured <= b.config.warmup_steps or b.seconds_left() is None:
            return False
        self._probed = True
        log.info("slurmclock: a first save to measure its time (no save measured yet)")
        return True

    def _measure_launch(self) -> None:
        """Once, after the warm-up (off the way to the first step): the allocation's launch,
        from which the budget guesses the exit until one is measured. On one node only: across
        nodes the exit also tears down what the launch did not build (the communication between
        them), so the plain guess stands until the job's timeline has measured an exit."""
        if self._launch_asked or self.budget.steps_measured <= self.budget.config.warmup_steps:
            return
        self._launch_asked = True
        if num_nodes() > 1:
            return
        given = self._launch
        launch = given() if callable(given) else measured_launch() if given is None else given
        if launch is not None:
            self.budget.record_launch(launch)

    # -- saves -----------------------------------------------------------------------------

    def saving(self, action: Action) -> _Saving:
        """``with loop.saving(act):`` around the save ``act`` asked for. For an extra save a
        watchdog ends the process (exit 75, timeline marked) if the block is still running when
        the exit must begin or on a stop signal. On leaving a final or extra save's block (which
        made it durable) the loop plans the next extra save, or ends."""
        return _Saving(self, action)

    def saved(self, step: int, seconds: float, *, background: bool = False) -> None:
        """The checkpoint of ``step`` is durable, ``seconds`` after its save began (timeline
        ``checkpoint step=N``). The stop's final save also marks ``saved`` (the exit starts); an
        extra save marks it again and is not a save-time sample (abandoned ones are missing)."""
        kind = self._issued.pop(step, "periodic")
        self.durable_step = step if self.durable_step is None else max(step, self.durable_step)
        if kind == "extra":
            self.budget.extra_saved(seconds, step=step)
        else:
            final = kind == "final"
            self.budget.record_save(seconds, final=final, background=background, step=step)

    def final_try_time(self) -> float | None:
        """Seconds one more try of the final save may still take (None: no deadline): the time
        left, less what the exit needs after the save and a save's measured length. A trainer
        whose final save failed (a store that does not answer) tries again while its pause plus
        its last try's length fit in this; <= 0: no try fits."""
        left = self.budget.seconds_left()
        if left is None:
            return None
        return left - self.budget.needed_after_save() - (self.budget.save_estimate or 0.0)

    def _save_done(self, action: Action) -> None:
        """A final or extra save's block ended: every rank plans (rank 0's plan) or ends."""
        self.paused()
        if action.save not in ("final", "extra"):
            return
        self.durable_step = self._save_step
        if self.finished or self.cause != "time" or not self.extra_saves:
            self._plan, self._phase = None, "exit"
            return
        plan = self._next_plan() if self.leader else None
        self._plan = self._share(plan)
        self._phase = "extra" if self._plan is not None else "exit"
        if self._plan is not None and self.leader:
            log.info("step %d: %s", self._save_step, self._plan.reason)

    def _next_plan(self) -> ExtraSave | None:
        plan = self.budget.extra_save()
        if plan is None or not plan.step_fits(self.budget.now(), self.budget.step_estimate or 0):
            return None
        return plan

    def _abandon(self, why: str) -> None:
        """On the watchdog thread, just before the process exits 75: say so, everywhere."""
        step, kept = self._save_step, self.durable_step
        self.finished = False  # the checkpoint that stands is older than the last step
        self.abandoned = (
            f"extra save of step {step} abandoned ({why}): step {kept} is the checkpoint"
        )
        log.warning("%s", self.abandoned)
        self.budget.extra_abandoned(step)
        if self.on_abandon is not None:
            self.on_abandon(self.abandoned)

    def stop_message(self, step: int, total: int | None = None) -> str:
        """One line for the log when the loop stops early."""
        of = f"/{total}" if total else ""
        return (
            f"slurmclock: stopping at step {step}{of} ({self.reason}); "
            f"exit {EXIT_STOPPED} = resume later"
        )


class _Saving:
    """The context of one save: the watchdog around an extra save, the plan after it."""

    def __init__(self, loop: TimeLoop, action: Action) -> None:
        self.loop, self.action = loop, action
        self.watchdog: _Watchdog | None = None

    def __enter__(self) -> _Saving:
        loop, plan = self.loop, self.loop.plan
        if self.action.save == "extra" and plan is not None and loop._watchdog:
            budget = loop.budget
            self.watchdog = _Watchdog(
                plan.abandon_at,
                on_abandon=loop._abandon,
                interrupted=budget.stop_signal,
                clock=budget.now,
                exit=lambda: loop._exit(EXIT_STOPPED),
            )
            self.watchdog.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        if exc_type is None:
            self.loop._save_done(self.action)


class _Watchdog:
    """If not stopped by ``at`` (epoch seconds, by ``clock``) or when ``interrupted()`` gives a
    reason, runs ``on_abandon(why)``, flushes the logs and calls ``exit()``. ``os._exit`` is the
    one way out that does not wait for a thread still writing (a storage client may not be
    interruptible). A body that ends first wins: the watchdog then does nothing (a lock)."""

    def __init__(
        self,
        at: float,
        *,
        on_abandon: Callable[[str], None],
        interrupted: Callable[[], str | None],
        clock: Callable[[], float],
        exit: Callable[[], None],
        poll: float = 0.05,
    ) -> None:
        self.at, self.poll, self.clock, self.exit = at, poll, clock, exit
        self.on_abandon, self.interrupted = on_abandon, interrupted
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="slurmclock-abandon", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._lock:  # once the watchdog holds it, the process is on its way out
            self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._done.wait(max(0.0, min(self.poll, self.at - self.clock()))):
            why = self.interrupted()
            if why is None and self.clock() < self.at:
                continue
            with self._lock:
                if self._done.is_set():
                    return
                try:
                    self.on_abandon(why or "the exit must begin")
                except Exception as e:  # the exit matters more than its description
                    log.error("while abandoning: %s", e)
                finally:
                    flush_logs()
                    self.exit()
                return


class TimeAware:
    """What the Lightning and Hugging Face callbacks share: ``loop``, ``budget``,
    ``stopped_early``, ``exit_code`` and :meth:`exit`."""

    loop: TimeLoop

    @staticmethod
    def make_loop(
        budget: TimeBudget | None,
        *,
        deadline: DeadlineWatcher | Deadline | None,
        margin: float | None,
        initial_save_estimate: float | None,
        warmup_steps: int,
        signals: Iterable[str | int],
        **loop_kw: Any,
    ) -> TimeLoop:
        """A callback's loop: its own stop signals, its budget ready-made or from the settings."""
        names = tuple(signals) or STOP_SIGNALS
        if budget is not None:
            return TimeLoop(budget, signals=names, **loop_kw)
        return TimeLoop(
            deadline=deadline,
            margin=margin,
            initial_save_estimate=initial_save_estimate,
            warmup_steps=warmup_steps,
            signals=names,
            **loop_kw,
        )

    @property
    def budget(self) -> TimeBudget:
        return self.loop.budget

    @property
    def stopped_early(self) -> bool:
        return self.loop.stopped_early

    @property
    def exit_code(self) -> int:
        """75 (EX_TEMPFAIL) after an early stop with steps left, 0 otherwise."""
        return self.loop.exit_code

    def exit(self) -> NoReturn:
        """End the process with :attr:`exit_code`, without the interpreter's teardown
        (:func:`end_process`): in a SLURM job that teardown is part of the allocation's exit."""
        end_process(self.exit_code)


def measured_launch() -> float | None:
    """Seconds from this allocation's start (SLURM) to this process's start: batch script,
    ``srun``, Python; None outside SLURM or when SLURM gives no start time (one ``squeue``)."""
    if job_id() is None:
        return None
    start = allocation_start()
    if start.source == "process":
        return None
    return max(0.0, process_start_time() - start.at)


def flush_logs() -> None:
    """What ``os._exit`` would drop: buffered log records and console output."""
    manager = logging.Logger.manager
    loggers = [logging.getLogger(), *manager.loggerDict.values()]
    handlers = {h for lg in loggers if isinstance(lg, logging.Logger) for h in lg.handlers}
    for target in (*handlers, sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed stream: nothing to keep
            target.flush()


def end_process(code: int) -> NoReturn:
    """End this process with ``code`` now, without the interpreter's teardown.

    Python's exit tears down every module after the work is done: for a process that imported
    torch about 1 s on an idle machine, 15 s measured on a loaded one. In a SLURM job that is
    part of the allocation's exit, which the time budget must keep free. This does what matters
    of a normal exit -- threading's exit hooks and non-daemon threads (as the interpreter does),
    the ``atexit`` handlers (temporary folders, process pools), logging and the standard streams
    flushed -- then ``os._exit(code)``. Files you left open are not flushed: close them first.
    """
    shutdown = getattr(threading, "_shutdown", None)
    run_exitfuncs = getattr(atexit, "_run_exitfuncs", None)
    if shutdown is None or run_exitfuncs is None:  # not CPython: the ordinary way
        sys.exit(code)
    if threading.current_thread() is threading.main_thread():
        shutdown()
    run_exitfuncs()
    flush_logs()
    os._exit(code)
