"""Calibration passes that survive bad conversations: a conversation that fails to encode, fails in a pass or
gives an empty reply is skipped and named (file:line or builtin:N), counted per pass in report.json, and the run
fails only below MIN_CALIBRATION usable conversations per stack."""

from __future__ import annotations

import gc
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from orin.errors import InputError


class Sample(Protocol):
    """What skipping reads of a calibration sample (quantize.calibration.Sample, which imports this module)."""

    name: str
    modalities: frozenset[str]
    heldout: bool


BUILTIN_SOURCE = "the built-in calibration set"
MIN_CALIBRATION = 2  # calibration conversations a stack needs in each pass (or all planned, when fewer)
STAGES = ("encode", "thinker", "speech")
# What the processor and the model raise on one input they cannot handle (transformers' generate() raises
# RuntimeError when the talker speaks no frame); InputError covers the encoding failures and empty replies.
SKIPPABLE = (InputError, RuntimeError, ValueError, IndexError)


class TooFewConversations(InputError):
    """Too few calibration conversations are left once the unusable ones are skipped."""


class UnusableConversation(InputError):
    """The BF16 model gives nothing to calibrate on for this conversation (an empty reply)."""


def exception_text(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if not isinstance(exc, InputError):
        text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def release_frames(exc: BaseException) -> None:
    """Clear the local variables of the finished frames in `exc`'s tracebacks (its cause and context included):
    the tensors a failed forward pass held die then, not with the exception, which its frames often reference
    back (a cycle only the garbage collector breaks, whenever it runs)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)  # frames still running are left alone
        exc = exc.__cause__ or exc.__context__


@dataclass(frozen=True)
class Skip:
    origin: str
    stage: str  # one of STAGES
    reason: str

    def to_json(self) -> dict:
        return {"origin": self.origin, "pass": self.stage, "reason": self.reason}


class Skips:
    """The conversations skipped so far; each is announced with a warning when it happens."""

    def __init__(self, log: Callable[[str], None]):
        self.items: list[Skip] = []
        self.log = log

    def add(self, origin: str, stage: str, exc: BaseException) -> Skip:
        skip = Skip(origin, stage, exception_text(exc))
        self.items.append(skip)
        where = "cannot be encoded" if stage == "encode" else f"{stage} pass"
        self.log(f"warning: skipping calibration conversation {origin} ({where}): {skip.reason}")
        return skip

    def to_json(self) -> dict:
        return {"skipped": [s.to_json() for s in self.items],
                "skipped_counts": {stage: sum(s.stage == stage for s in self.items) for stage in STAGES}}


def too_few(source: str, what: str, usable: int, need: int, skips: Skips) -> TooFewConversations:
    why = ""
    if skips.items:
        first = skips.items[0]
        why = f"; {len(skips.items)} were skipped (first: {first.origin}: {first.reason})"
    fix = ("add more or other conversations to --calib" if source != BUILTIN_SOURCE
           else "calibrate on real conversations with --calib")
    return TooFewConversations(f"{source}: {usable} calibration conversation(s) {what}, {need} needed{why}. "
                               f"To fix it, {fix}; the warnings above say why each one was skipped")


@dataclass
class PassResult:
    """Which conversations one pass calibrated on and held out, and which it skipped."""

    stage: str
    calibration: list[Sample] = field(default_factory=list)
    heldout: list[Sample] = field(default_factory=list)
    skipped: list[Sample] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"conversations": len(self.calibration), "heldout": len(self.heldout),
                "heldout_names": [s.name for s in self.heldout], "skipped": len(self.skipped)}


@dataclass
class PassRunner:
    """Runs one pass over the calibration samples, skipping the conversations it fails on (see the module
    docstring) and showing its progress."""

    source: str
    skips: Skips
    progress: object  # quantize.progress.Progress

    def run(self, stage: str, samples: list[Sample], work: Callable[[Sample, bool], Callable[[], None]],
            calibration_limit: int | None = None, needs: dict[str, str] | None = None,
            prepare: Callable[[list[Sample]], None] | None = None, batch: int = 1) -> PassResult:
        """work(sample, heldout) runs the model and returns a commit() that stores what it recorded: a
        conversation that raises one of SKIPPABLE stores nothing. Held-out samples run first, so a skipped one
        can be replaced by a calibration sample not yet run. At most `calibration_limit` calibration samples
        are used (more are drawn when some are skipped). `needs` maps a stack's title to the modality its
        calibration conversations must have ("text": all), or to a tuple of modalities, any of which will do
        (the vision encoder's: an image or a video). `prepare(samples)`, when given, runs before work() for up
        to `batch` samples at once: the sample about to run and those expected next (work whose cost is shared
        between conversations, such as the speech pass's streamed replies), fewer while samples prepared before
        have not run yet, so that at most `batch` are prepared and waiting at any time; what it prepares never
        changes which conversations are used."""
        needs = {title: (m,) if isinstance(m, str) else tuple(m) for title, m in (needs or {}).items()}
        queue = [s for s in samples if s.heldout]
        candidates = [s for s in samples if not s.heldout]
        want = len(candidates) if calibration_limit is None else min(len(candidates), calibration_limit)
        planned = {title: sum(_uses(s, m) for s in candidates[:want]) for title, m in needs.items()}
        result = PassResult(stage)
        prepared: set[int] = set()
        tried: set[int] = set()

        def upcoming() -> list[Sample]:
            """The samples expected to run next, in order, if none of them is skipped."""
            need = want - len(result.calibration)
            rest = [c for c in candidates if id(c) not in tried][:max(need, 0)]
            return [s for s in queue if id(s) not in tried] + rest

        def attempt(sample: Sample, heldout: bool) -> bool:
            tried.add(id(sample))
            if prepare is not None and id(sample) not in prepared:
                ahead = [sample] + [s for s in upcoming() if id(s) not in prepared and s is not sample]
                waiting = len(prepared - tried)  # prepared earlier, not run yet (their replies are held)
                ahead = ahead[:max(1, batch - waiting)]
                prepared.update(id(s) for s in ahead)
                prepare(ahead)
            try:
                commit = work(sample, heldout)
            except SKIPPABLE as exc:
                release_frames(exc)  # what the conversation held when it failed goes now
                self.skips.add(sample.name, stage, exc)
                commit = None
            if commit is None:
                # and what reference cycles hold (transformers' hooks leave some around a failed forward pass):
                # now, not whenever Python's collector next gets to them
                gc.collect()
                result.skipped.append(sample)
                return False
            commit()
            (result.heldout if heldout else result.calibration).append(sample)
            return True

        with self.progress.bar(len(queue) + want, f"{stage} pass", unit="conversation") as bar:
            while queue:
                sample = queue.pop(0)
                ok = attempt(sample, True)
                bar.update(1)
                if ok:
                    continue
                stand_in = _stand_in(sample, candidates, last_resort=not result.heldout and not queue)
                if stand_in is not None:
                    self.skips.log(f"note: holding out {stand_in.name} for the report in place of {sample.name}")
                    candidates.remove(stand_in)
                    stand_in.heldout = True
                    queue.append(stand_in)
                    fewer = want - min(want, len(candidates))
                    want -= fewer
                    bar.grow(1 - fewer)
            if not result.heldout:
                raise too_few(self.source, f"held out for the report in the {stage} pass", 0, 1, self.skips)
            for i, sample in enumerate(candidates):
                if len(result.calibration) >= want:
                    break
                if not attempt(sample, False) and len(candidates) - i - 1 > want - len(result.calibration):
                    bar.grow(1)  # another candidate is drawn in its place
                bar.update(1)
        for title, modalities in needs.items():
            usable = sum(_uses(s, modalities) for s in result.calibration)
            need = min(MIN_CALIBRATION, planned[title])
            if usable < need:
                media = "" if modalities == ("text",) else \
                    f" with {' or '.join(_MEDIA_WORDS.get(m, m) for m in modalities)}"
                raise too_few(self.source, f"{media} for the {title} in the {stage} pass".lstrip(), usable, need,
                               self.skips)
        return result


_MEDIA_WORDS = {"image": "an image", "video": "a video"}


def _uses(sample: Sample, modalities: tuple[str, ...]) -> bool:
    return any(m in sample.modalities for m in modalities)


def _stand_in(failed: Sample, candidates: list[Sample], last_resort: bool) -> Sample | None:
    """The calibration sample to hold out in place of `failed`: the last one with the same media (so each
    encoder keeps a held-out measurement) whose loss leaves MIN_CALIBRATION calibration samples with each of its
    modalities; with last_resort (no held-out sample would be left), the last such one whatever its media."""
    def spare(c: Sample) -> bool:
        return all(sum(m in o.modalities for o in candidates if o is not c) >= MIN_CALIBRATION for m in c.modalities)

    for c in reversed(candidates):
        if c.modalities >= failed.modalities and spare(c):
            return c
    if last_resort:
        for c in reversed(candidates):
            if spare(c):
                return c
    return None
