"""``auto``'s plan: which transport serves each call size, measured on the machine it runs on.

No fabric can be known in advance: peer writes collapse on some PCIe topologies, peer reads on
others (``docs/design.md``, section 5.11). So at construction every rank times each candidate
transport (the push and the pull) over a ladder of call sizes (``measure``), the ranks
exchange their tables, and each derives the same plan from the same numbers (``choose``): for each
collective and measured size, the candidate whose slowest rank was fastest. Where that sends a
size's gather and combine to different transports, a layer (the gather, then the combine) is timed
on each transport alone and that way (``layer_points``), once as SGLang calls it and once with a
decode batch's metadata, as vLLM's MLA layers do: on one H200 a pulled gather and a pushed combine
took 1.18x the pull alone, and on one H100 the metadata cost a pushed combine more than a pulled
one. Where the mix is as fast as the fastest layer both ways, each collective keeps its own choice;
else the first layer that is (or the one least behind) serves both within a layer, and a combine
that does not follow a gather on its channel (``combine_alone``: a FlashAttention layer's) keeps
its own. Every rank therefore sends a call of a given size, after the same calls, to the
same transport, whatever its own clock said.
"""

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch

from dcp.errors import DcpError
from dcp.constants import KIND_COMBINE, KIND_GATHER
from dcp.rendezvous import all_gather

KINDS = {KIND_COMBINE: "combine", KIND_GATHER: "gather"}
LAYER = "layer"  # a layer's key in a table: (LAYER, gather's transport, combine's transport, size)
LAYER_META = "layer, metadata"  # the same layer, its combine given a decode batch's metadata
COMBINE_META = "combine, metadata"  # a call's kind in a layer point: the combine with that metadata
ALONE = "combine alone"  # the routes of combines that do not follow a gather on their channel
# Within this fraction of the fastest, or this many us, a time ties with it: of the collectives' own
# choices the push wins a tie (the most proven), of the layers the mix (``choose``). Timed in graphs
# replayed four times (050b03b, one H200; docs/design.md, section 5.11), the plan came within about
# 1% of the benchmark's graph8 medians where its log prints both; a 2% tie there gave the N = 3
# layer at B = 64 to the push (plan 26.1 against the pull's 25.6; graph8 26.8 against 25.8). The
# 0.3 us covers the small calls' noise (at e3e6c68 the N = 6 ones were 0.8-1.7 us off).
TIE, TIE_US = 0.01, 0.3


def _ties(t: float, best: float) -> bool:
    return t <= max(best * (1 + TIE), best + TIE_US)


def ladder(max_tokens: int) -> list:
    """The call sizes measured: powers of two below ``max_tokens``, and ``max_tokens``."""
    return [1 << i for i in range(max_tokens.bit_length()) if 1 << i < max_tokens] + [max_tokens]


@dataclass(frozen=True)
class Route:
    """Calls of ``lo`` to ``hi`` tokens (``hi`` None: no bound; above ``max_tokens`` a call runs in
    chunks of it) of one collective (``kind``: combine, gather, or ``ALONE``) go to ``transport``;
    ``times_us``: each candidate's time per call at the size ``at`` that decided it (its slowest
    rank's)."""
    kind: str
    lo: int
    hi: Optional[int]
    transport: str
    at: int
    times_us: dict


class Plan:
    """The agreed plan (identical on every rank): ``transport(kind, B)``, its ``routes``, the
    candidates ``left_out`` and why, how long the measurement took (``seconds``), the ``layers``
    timed (``(gather's, combine's)`` and, with metadata, ``(gather's, combine's, "metadata")``)
    and the (kind, size) whose choice they changed (``overruled``)."""

    def __init__(self, max_tokens: int, choices: dict, left_out: dict, seconds: float, candidates: list,
                 tables: list, sizes: list, layers: dict, overruled: set, alone: Optional[list] = None):
        """``choices``: kind -> [(size, transport, {candidate: us})] by increasing size; ``candidates``,
        ``tables`` and ``sizes``: what ``choose`` decided from; ``layers``: size -> {(gather's
        transport, combine's transport): us} where layers were timed; ``alone``: the combine's own
        choices, in the form of ``choices``' (default: its choices)."""
        self.max_tokens, self.left_out, self.seconds = max_tokens, dict(left_out), seconds
        self._choices, self.candidates, self.tables, self.sizes = choices, candidates, tables, sizes
        self.layers, self.overruled = layers, overruled
        self._alone = alone if alone is not None else choices[KIND_COMBINE]
        # kind -> transport by call size, index 0 (B = 0) to max_tokens: the smallest measured size >= B.
        self.by_size = {kind: self._by_size(points) for kind, points in choices.items()}
        # A combine that does not follow a gather on its channel (no layer): its own choice.
        self.combine_alone = self._by_size(self._alone)

    def _by_size(self, points: list) -> list:
        names, i = [], 0
        for b in range(self.max_tokens + 1):
            while points[i][0] < b:
                i += 1
            names.append(points[i][1])
        return names

    def times(self, kind: int) -> list:
        """Every measured size of a collective: (size, the transport chosen, {candidate: us})."""
        return list(self._choices[kind])

    def transport(self, kind: int, n_tokens: int) -> str:
        return self.by_size[kind][min(max(n_tokens, 0), self.max_tokens)]

    @property
    def transports(self) -> list:
        """The transports some call size goes to, in the order they were candidates."""
        used = {name for names in [*self.by_size.values(), self.combine_alone] for name in names}
        return [name for name in self.candidates if name in used]

    @property
    def routes(self) -> list:
        """Each collective's ranges of sizes and their transports; ``combine alone`` (a combine that
        does not follow a gather on its channel) only where a layer changed the combine's choice."""
        kinds = [(KINDS[kind], points) for kind, points in self._choices.items()]
        if self.combine_alone != self.by_size[KIND_COMBINE]:
            kinds.append((ALONE, self._alone))
        out = []
        for kind, points in kinds:
            lo = 1
            for i, (b, name, times) in enumerate(points):
                last = i == len(points) - 1
                if not last and points[i + 1][1] == name:
                    continue  # merged with the next size's route
                out.append(Route(kind, lo, None if last else b, name, b, times))
                lo = b + 1
        return out

    def __str__(self) -> str:
        lines = [f"auto plan (measured in {self.seconds:.2f} s; us per call, slowest rank, at the size that "
                 "decided each range):"]
        routes = self.routes
        w = max([7] + [len(r.kind) for r in routes])  # "combine alone" lines align with the rest
        for r in routes:
            hi = self.max_tokens if r.hi is None else r.hi
            by = "; a layer decided" if any(KINDS[k] == r.kind and r.lo <= b <= hi for k, b in self.overruled) else ""
            lines.append(f"  {r.kind:{w}s} {_sizes(r):12s} {r.transport:6s}  (B = {r.at}: {_times(r.times_us)}{by})")
        for b, times in self.layers.items():
            lines.append(f"  {'layer':{w}s} B = {b:<8d} {_pair(self._layer_pair(b)):11s} "
                         f"({_times({_pair(p): us for p, us in times.items()})})")
        lines += [f"  left out: {name} ({why})" for name, why in self.left_out.items()]
        return "\n".join(lines)

    def _layer_pair(self, b: int) -> tuple:
        return self.by_size[KIND_GATHER][b], self.by_size[KIND_COMBINE][b]

    def times_at(self, sizes: Iterable[int]) -> str:
        """Per collective, for each of ``sizes`` (call sizes in tokens), the times measured at the
        size that routes it (us, slowest rank; "B = 3 (at 4)" where they differ), marked * the
        transport a call of it alone takes (a combine: ``combine_alone``), and the layers timed
        there, marked as a layer takes them: what a benchmark of those sizes can set its own
        medians beside."""
        at: dict = {}  # measured size -> the call sizes it routes
        for b in sizes:
            size = next(s for s in self.sizes if s >= min(max(b, 1), self.max_tokens))
            at.setdefault(size, []).append(b)

        def label(size: int) -> str:
            asked = sorted(set(at[size]))
            return f"B = {size}" if asked == [size] else f"B = {', '.join(map(str, asked))} (at {size})"

        if not at:
            return ""
        lines = []
        for kind, points in self._choices.items():
            times = {size: t for size, _, t in points}
            alone = self.combine_alone if kind == KIND_COMBINE else self.by_size[kind]
            lines.append(f"  {KINDS[kind]:7s} " + "; ".join(
                f"{label(size)}: " + _times({n + "*" * (n == alone[size]): us for n, us in times[size].items()})
                for size in sorted(at)))
        layers = [size for size in sorted(at) if size in self.layers]
        if layers:
            lines.append("  layer   " + "; ".join(f"{label(size)}: " + _times(
                {_pair(p) + "*" * (p[:2] == self._layer_pair(size)): us for p, us in self.layers[size].items()})
                for size in layers))
        return "\n".join(lines)

    def summary(self) -> str:
        """One line: the transport of each route."""
        return "; ".join(f"{r.kind} {_sizes(r)}: {r.transport}" for r in self.routes)

    def as_dict(self) -> dict:
        return {"seconds": self.seconds, "left_out": self.left_out,
                "routes": [dict(vars(r)) for r in self.routes],
                "layers": {b: {_pair(p): us for p, us in times.items()} for b, times in self.layers.items()}}

    def mixed_sizes(self) -> list:
        """The measured sizes whose gather and combine go to different transports."""
        return [b for b in self.sizes if self.by_size[KIND_GATHER][b] != self.by_size[KIND_COMBINE][b]]


def _pair(pair: tuple) -> str:
    """A layer's transports: one name where both collectives take it, else gather+combine; " meta"
    where its combine had metadata."""
    return (pair[0] if pair[0] == pair[1] else f"{pair[0]}+{pair[1]}") + " meta" * (len(pair) > 2)


def _sizes(r: "Route") -> str:
    return f"B {r.lo}-{r.hi}" if r.hi is not None else f"B >= {r.lo}"


def _times(times: dict) -> str:
    return "  ".join(f"{name} {us:.1f}" for name, us in times.items())


def choose(tables: list, candidates: list, sizes: list, left_out: dict, max_tokens: int, seconds: float,
           layer_tables: Optional[list] = None) -> Plan:
    """The plan from every rank's table (``tables[r][(candidate, kind, size)]``: us per call on rank
    r): at each size, each candidate's time is its slowest rank's, and the fastest wins (ties within
    ``TIE`` or ``TIE_US`` to the earlier candidate). ``candidates`` in order of preference, none left out.
    ``layer_tables[r][(LAYER, gather's, combine's, size)]`` (and ``LAYER_META``'s, where timed):
    where a size's two choices differ and its layers were timed, they stand if the mixed layer ties
    with the fastest layer in each way timed (a collective called alone then keeps its own faster
    transport); else the first layer in ``_layer_pairs``' order that does decides both, or where
    none does, the one least behind the fastest at its worst; the combine's own choice stays its
    route alone."""
    slowest = lambda key, ts: max(t[key] for t in ts)  # noqa: E731
    choices = {kind: [] for kind in KINDS}
    layers, overruled, alone = {}, set(), []
    for b in sizes:
        picked = {}
        for kind in KINDS:
            times = {name: slowest((name, kind, b), tables) for name in candidates}
            best = min(times.values())
            picked[kind] = next(name for name in candidates if _ties(times[name], best)), times
        alone.append((b, *picked[KIND_COMBINE]))
        mix = picked[KIND_GATHER][0], picked[KIND_COMBINE][0]
        pairs = _layer_pairs(mix, candidates)
        if mix[0] != mix[1] and layer_tables and all((LAYER, *p, b) in t for p in pairs for t in layer_tables):
            ways = [{p: slowest((LAYER, *p, b), layer_tables) for p in pairs}]
            if all((LAYER_META, *p, b) in t for p in pairs for t in layer_tables):
                ways.append({p: slowest((LAYER_META, *p, b), layer_tables) for p in pairs})
            fits = [p for p in [mix] + pairs if all(_ties(t[p], min(t.values())) for t in ways)]
            g, c = fits[0] if fits else min([mix] + pairs, key=lambda p: max(t[p] / min(t.values()) for t in ways))
            picked = {KIND_GATHER: (g, picked[KIND_GATHER][1]), KIND_COMBINE: (c, picked[KIND_COMBINE][1])}
            layers[b] = dict(ways[0])
            if len(ways) > 1:
                layers[b].update({(*p, "metadata"): us for p, us in ways[1].items()})
            overruled |= {(kind, b) for kind, name, was in ((KIND_GATHER, g, mix[0]), (KIND_COMBINE, c, mix[1]))
                          if name != was}
        for kind in KINDS:
            choices[kind].append((b, *picked[kind]))
    return Plan(max_tokens, choices, left_out, seconds, candidates, tables, sizes, layers, overruled, alone)


def _layer_pairs(mix: tuple, candidates: list) -> list:
    """The layers that check a mixed size: each candidate alone (one transport, the most proven
    first: the order of preference where the mix lost), then the mix (gather's transport, combine's)."""
    return [(name, name) for name in candidates] + [mix]


def op_points(candidates: list, sizes: list) -> list:
    """``measure``'s points for each candidate alone: every collective at every size."""
    return [((name, kind), ((name, kind),), b) for name in candidates for kind in KINDS for b in sizes]


def layer_points(plan: Plan) -> list:
    """``measure``'s points that check a plan's mixed sizes: at each, a layer (the gather, then the
    combine of the same size) as the plan has it, and on each of its candidates alone; each without
    and with metadata (its combine's kind ``COMBINE_META``)."""
    points = []
    for b in plan.mixed_sizes():
        pairs = _layer_pairs((plan.by_size[KIND_GATHER][b], plan.by_size[KIND_COMBINE][b]), plan.candidates)
        points += [((key, g, c), ((g, KIND_GATHER), (c, kind)), b)
                   for key, kind in ((LAYER, KIND_COMBINE), (LAYER_META, COMBINE_META)) for g, c in pairs]
    return points


def agree_plan(group, table: dict, failed: dict, seconds: float, candidates: list, sizes: list, left_out: dict,
               max_tokens: int, checked: Optional[Plan] = None) -> Plan:
    """Collective: exchange every rank's ``measure`` results and derive the same plan on every rank.
    A candidate that failed on any rank is left out (with the first such rank's reason), as are
    those in ``left_out`` already; if none is left, every rank raises alike. ``checked``: the plan
    whose ``layer_points`` gave ``table`` (its candidates' own times decide again, with the layers)."""
    facts = all_gather(group, (table, failed, seconds), "measuring the transports")
    left_out = dict(left_out)
    for r, (_, fails, _) in enumerate(facts):
        for name, why in fails.items():
            left_out.setdefault(name, f"failed on rank {r} while measured: {why}")
    kept = [name for name in candidates if name not in left_out]
    if not kept:
        raise DcpError(f"auto: every transport failed while measured: {left_out}")
    seconds = max(f[2] for f in facts)
    if checked is None:
        return choose([f[0] for f in facts], kept, sizes, left_out, max_tokens, seconds)
    return choose(checked.tables, kept, sizes, left_out, max_tokens, seconds, [f[0] for f in facts])


def measure(runs: dict, failure: Callable[[str], Optional[str]], points: list, timer, warm: int, reps: int,
            rounds: int) -> tuple:
    """This rank's table ``{key + (size,): us per step}`` and its failures ``{candidate: why}``.

    ``points``: ``[(key, calls, size)]`` (``op_points``, ``layer_points``), a step being ``calls``
    ``((candidate, kind), ...)`` issued in order; ``runs[candidate](kind, size)`` issues one call
    (every rank issues the same calls in the same order); ``failure(candidate)`` reads a
    candidate's recorded failure after them. Of a point's ``warm`` steps the first runs at once
    (it lines the ranks up, and a call that raises there does so outside any capture); then
    ``timer.best(step, warm - 1, reps, rounds)`` times it: us per step, the best of ``rounds`` runs
    (each of ``reps`` steps, or ``GraphTimer``'s replays of them), each behind the other warm
    steps. A candidate that raises is not called here again (the others' calls go on, the same on
    every rank), and it is left out on every rank. Its
    run should announce the failed call, so that the peers' call fails at once: on the timeout
    (bounded waits), their next calls on another candidate would start a timeout after this rank's
    and fail too. (Under ``GraphTimer`` a call that raises only while captured has its announcement
    captured too, and a capture refused on one rank is announced to nobody: the peers' replays then
    wait out their timeouts, so the candidate fails on every rank, late but bounded.)
    """
    table, failed = {}, {}

    def step(calls: tuple, b: int) -> None:
        for name, kind in calls:
            if name not in failed:
                try:
                    runs[name](kind, b)
                except Exception as exc:  # left out on every rank once the failures are exchanged
                    failed[name] = f"{type(exc).__name__}: {exc}"

    for key, calls, b in points:
        if all(name in failed for name, _ in calls):
            continue
        if warm:
            step(calls, b)
            if all(name in failed for name, _ in calls):
                continue
        try:
            table[key + (b,)] = timer.best(lambda: step(calls, b), max(warm - 1, 0), reps, rounds)
        except Exception as exc:  # the timer itself (a capture refused): the point's candidates are out
            failed.update({name: f"timing: {type(exc).__name__}: {exc}" for name, _ in calls if name not in failed})
    for name in dict.fromkeys(name for _, calls, _ in points for name, _ in calls):
        if name in failed:
            continue
        why = failure(name)
        if why is not None:
            failed[name] = why
    return table, failed


def _check_counts(reps: int, rounds: int) -> None:
    if reps < 1 or rounds < 1:
        raise ValueError(f"reps and rounds: expected at least 1, got {reps} and {rounds}")


class HostTimer:
    """Wall time of synchronous calls (Triton's interpreter)."""

    def best(self, step: Callable[[], None], warm: int, reps: int, rounds: int) -> float:
        _check_counts(reps, rounds)
        best = float("inf")
        for _ in range(rounds):
            for _ in range(warm):
                step()
            t0 = time.perf_counter()
            for _ in range(reps):
                step()
            best = min(best, (time.perf_counter() - t0) * 1e6 / reps)
        return best


class GraphTimer:
    """Device time per step of ``reps`` steps captured in one CUDA graph, as a served model's decode
    and the benchmark's graph8 mode run them: eager launches had the plan disagree with graph
    replays at small calls (docs/design.md, section 5.11). Each round first occupies the stream for
    ``hold_us`` (``torch.cuda._sleep``) while the host queues the rest, then replays the ``warm``
    steps' graph (its first call waits for every peer: the ranks start the timed replays together),
    then the timed one ``replays`` times back to back between two events, as the benchmark replays
    its graphs: what the first replay and the events cost is spread over ``replays * reps`` steps."""

    def __init__(self, device: torch.device, hold_us: float = 1000.0, replays: int = 4):
        if replays < 1:
            raise ValueError(f"replays: expected at least 1, got {replays}")
        self.device, self.stream, self.replays = device, torch.cuda.current_stream(device), replays
        self.side = torch.cuda.Stream(device)
        self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.hold_cycles = 1 << 20
        self.a.record(self.stream)
        self._hold()
        self.b.record(self.stream)
        self.b.synchronize()
        self.hold_cycles = int(self.hold_cycles / (self.a.elapsed_time(self.b) * 1e3) * hold_us)

    def _hold(self) -> None:
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            torch.cuda._sleep(self.hold_cycles)

    def _capture(self, step: Callable[[], None], n: int) -> "torch.cuda.CUDAGraph":
        # capture_begin itself, not torch.cuda.graph: that one collects garbage and empties the cache
        # on every entry. Our calls allocate nothing, so the graph's private pool stays empty.
        graph = torch.cuda.CUDAGraph()
        self.side.wait_stream(self.stream)
        with torch.cuda.device(self.device), torch.cuda.stream(self.side):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                for _ in range(n):
                    step()
            finally:
                graph.capture_end()
        self.stream.wait_stream(self.side)
        return graph

    def best(self, step: Callable[[], None], warm: int, reps: int, rounds: int) -> float:
        """``warm`` 0: no line-up graph (the timed replay then includes the ranks' skew)."""
        _check_counts(reps, rounds)
        graphs, best = [], float("inf")
        try:
            for n in (warm, reps):  # each kept as captured: a later capture that raises still resets it
                if n:
                    graphs.append(self._capture(step, n))
            for _ in range(rounds):
                self._hold()
                with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                    for graph in graphs[:-1]:
                        graph.replay()
                    self.a.record(self.stream)
                    for _ in range(self.replays):
                        graphs[-1].replay()
                    self.b.record(self.stream)
                self.b.synchronize()
                best = min(best, self.a.elapsed_time(self.b) * 1e3 / (reps * self.replays))
        finally:
            for graph in graphs:
                graph.reset()
        return best
