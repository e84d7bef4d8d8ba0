"""`nox -s chaos` (DGR-063): seeded fault injection into real routes serving concurrent sessions.

Two disjoint 3-stage forward-mode routes of SmolLM2 run on real workers, every stage behind a
netsim link that the coordinator and the stage before it both go through. Faults hit route A
only; route B's session runs beside each fault and must finish untouched, without an error.
Each fault cycle starts two sessions on A and one on B, injects one fault into A once A's
sessions are generating, waits for the typed error naming the stage, heals (SIGCONT, a restart
on the same port, the link back), and lets RouteSession resume on the healed route. Every
session's greedy output must equal its uninterrupted run.

Faults: SIGKILL of a stage (then restarted on the same port), SIGSTOP, a delay spike on a link,
a link blackholed (bytes dropped, connections held open, no reset), a link reset, a byte
corrupted in a boundary in flight, a stale epoch and a wrong prefix hash sent to a stage, and a
client that vanishes mid-stream (the stages must free its session).

`python -m dgr_cert.chaos --seed S --faults N` is reproducible: the schedule (kinds, stages,
delays) comes from the seed; `--only I` replays fault I alone. Writes evidence/chaos/chaos.json.
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import signal
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
from dgr.v1 import shard_pb2 as pb
from dgr.v1 import shard_pb2_grpc as pb_grpc
from dgr_bench.netsim import LinkProcess, start_link
from dgr_cli.workers import WorkerProcess, descriptor_args, start_worker
from dgr_prd.paths import find_root
from dgr_records import report
from dgr_route.route import Route, RouteError
from dgr_route.session import RouteSession
from dgr_wire.codec import FNV_OFFSET, prefix_hash

LAYOUT = [(0, 10), (10, 20), (20, 30)]
KINDS = (
    "kill",
    "stop",
    "delay",
    "blackhole",
    "reset",
    "corrupt",
    "stale_epoch",
    "wrong_prefix",
    "client_vanish",
)
TIMEOUT_S = 3.0  # the routes' per-token deadline: a hung stage is named within it plus a probe
DEADLINE_S = TIMEOUT_S + 2.5  # a fault's typed error must arrive within this
TOKENS = 20
HANG_S = 60.0  # a session not finished this long after its fault counts as hung


@dataclass
class Fault:
    index: int
    kind: str
    stage: int
    delay_s: float  # after A's sessions produced their first token


@dataclass
class Outcome:
    index: int
    kind: str
    stage: int
    detected: bool | None = None  # None: a fault that must be tolerated (no error)
    detect_s: float | None = None
    named_stage: int | None = None
    code: str | None = None
    sessions: int = 0
    identical: int = 0
    hung: int = 0
    lost: int = 0
    untouched_errors: int = 0
    problems: list[str] = field(default_factory=list)


def schedule(seed: int, n: int) -> list[Fault]:
    """Every kind in turn, stage and timing drawn from the seed."""
    rng = random.Random(seed)
    return [
        Fault(i, KINDS[i % len(KINDS)], rng.randrange(len(LAYOUT)), rng.uniform(0.0, 0.15))
        for i in range(n)
    ]


class Fleet:
    """Route A (faulted) and route B (untouched), each stage behind its own controllable link."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self.descriptor = descriptor_args(model)
        self.workers: dict[str, list[WorkerProcess]] = {}
        self.links: dict[str, list[LinkProcess]] = {}
        for name in ("A", "B"):
            self.workers[name] = [self._start(a, b) for a, b in LAYOUT]
            self.links[name] = [
                start_link(w.address, 0.0, control=True) for w in self.workers[name]
            ]

    def _start(self, first: int, last: int, port: int = 0) -> WorkerProcess:
        return start_worker(
            self.model,
            first,
            last,
            port=port,
            descriptor=self.descriptor,
            threads=1,
            n_ctx=512,
            max_sessions=8,
        )

    def route(self, name: str) -> Route:
        """A route over `name`'s links, once every stage answers (after a heal, a restarted
        stage may still be loading)."""
        addresses = [link.address for link in self.links[name]]
        deadline = time.monotonic() + 30
        while True:
            try:
                return Route.open(addresses, timeout=TIMEOUT_S, peers=addresses)
            except RouteError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def restart(self, stage: int) -> None:
        """Stage `stage` of A again, on the port it had."""
        old = self.workers["A"][stage]
        port = int(old.address.rsplit(":", 1)[1])
        old.kill()
        a, b = LAYOUT[stage]
        deadline = time.monotonic() + 20
        while True:
            try:
                self.workers["A"][stage] = self._start(a, b, port)
                return
            except Exception:  # the port may linger a moment after the kill
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def sessions(self, name: str) -> list[int]:
        return [w.sessions() for w in self.workers[name]]

    def stop(self) -> None:
        for links in self.links.values():
            for link in links:
                link.stop()
        for workers in self.workers.values():
            for w in workers:
                w.kill()


class Session(threading.Thread):
    """One RouteSession generating greedily; resumes on `replacement` after a RouteError."""

    def __init__(
        self,
        route: Route,
        prompt: list[int],
        replacement: Callable[[RouteError], Route | None] | None,
        first_token: threading.Event | None = None,
    ) -> None:
        super().__init__(daemon=True)
        self.session = RouteSession(route, max_resumes=3)
        self.prompt = prompt
        self.replacement = replacement
        self.first_token = first_token
        self.tokens: list[int] = []
        self.error: BaseException | None = None
        self.errors: list[tuple[float, RouteError]] = []

    def run(self) -> None:
        def replace(err: RouteError) -> Route | None:
            self.errors.append((time.monotonic(), err))
            return self.replacement(err) if self.replacement else None

        try:
            for token in self.session.generate(self.prompt, TOKENS, replace=replace):
                self.tokens.append(token)
                if self.first_token is not None:
                    self.first_token.set()
        except BaseException as exc:  # recorded: the cycle reports it
            self.error = exc


def prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 6000) for _ in range(rng.randrange(8, 40))] for _ in range(n)]


class Chaos:
    def __init__(self, fleet: Fleet, seed: int) -> None:
        self.fleet = fleet
        self.seed = seed
        self.pool = prompts(seed, 8)
        # the uninterrupted runs every faulted one must equal
        route = fleet.route("B")
        self.reference = [list(RouteSession(route).generate(p, TOKENS)) for p in self.pool]
        route.close()
        self.healed = threading.Event()

    def cycle(self, fault: Fault) -> Outcome:
        out = Outcome(fault.index, fault.kind, fault.stage)
        self.healed.clear()
        if fault.kind in ("stale_epoch", "wrong_prefix", "client_vanish"):
            self.healed.set()  # nothing to heal: the route stays up
        picks = [(fault.index * 3 + k) % len(self.pool) for k in range(3)]
        route_a, route_b = self.fleet.route("A"), self.fleet.route("B")

        def replacement(err: RouteError) -> Route | None:
            if not self.healed.wait(HANG_S):
                return None
            return self.fleet.route("A")

        first = threading.Event()
        a_sessions = [
            Session(route_a, self.pool[picks[0]], replacement, first),
            Session(route_a, self.pool[picks[1]], replacement),
        ]
        b_session = Session(route_b, self.pool[picks[2]], None)
        for s in (*a_sessions, b_session):
            s.start()
        if not first.wait(HANG_S):
            out.problems.append("route A gave no token before the fault")
        time.sleep(fault.delay_s)
        injected = time.monotonic()
        expect_error = self.inject(fault, out)
        if expect_error:
            self.await_detection(a_sessions, injected, fault, out)
        self.heal(fault)
        self.healed.set()
        for s in (*a_sessions, b_session):
            s.join(HANG_S)
        for s, pick in zip((*a_sessions, b_session), picks, strict=True):
            out.sessions += 1
            if s.is_alive():
                out.hung += 1
                out.problems.append("a session hung")
            elif s.error is not None:
                out.lost += 1
                out.problems.append(f"a session was lost: {s.error}")
            elif s.tokens == self.reference[pick]:
                out.identical += 1
            else:
                out.problems.append("a session's output differs from its uninterrupted run")
        if b_session.errors or b_session.error is not None:
            out.untouched_errors += 1
            out.problems.append("route B's session saw an error")
        if expect_error and not out.detected:
            out.problems.append("no typed error naming the stage within the deadline")
        route_a.close()
        route_b.close()
        self.settle(out)
        return out

    def inject(self, fault: Fault, out: Outcome) -> bool:
        """Inject `fault` into route A; True when it must end A's sessions with a RouteError."""
        stage, fleet = fault.stage, self.fleet
        worker, link = fleet.workers["A"][stage], fleet.links["A"][stage]
        if fault.kind == "kill":
            worker.proc.send_signal(signal.SIGKILL)
        elif fault.kind == "stop":
            worker.proc.send_signal(signal.SIGSTOP)
        elif fault.kind == "delay":
            link.fault("delay 300")  # < TIMEOUT_S: slower, never an error
            return False
        elif fault.kind == "blackhole":
            link.fault("blackhole on")
        elif fault.kind == "reset":
            link.fault("reset")
        elif fault.kind == "corrupt":
            if stage == 0:  # the head's link carries token ids, no boundary: hit the next one
                fault.stage = out.stage = 1
                link = fleet.links["A"][1]
            link.fault("corrupt 1")
        elif fault.kind in ("stale_epoch", "wrong_prefix"):
            self.bad_expectation(fault, out)
            return False
        elif fault.kind == "client_vanish":
            self.vanishing_client(out)
            return False
        return True

    def await_detection(
        self, sessions: list[Session], injected: float, fault: Fault, out: Outcome
    ) -> None:
        deadline = injected + DEADLINE_S
        while time.monotonic() < deadline:
            errors = [e for s in sessions for e in s.errors]
            if errors:
                at, err = min(errors, key=lambda e: e[0])
                out.detect_s = round(at - injected, 3)
                out.named_stage = err.stage
                out.code = err.code.name if err.code else None
                out.detected = err.stage == fault.stage and out.detect_s <= DEADLINE_S
                if err.stage != fault.stage:
                    out.problems.append(f"the error names stage {err.stage}: {err}")
                return
            if all(not s.is_alive() for s in sessions):
                break
            time.sleep(0.01)
        out.detected = False

    def heal(self, fault: Fault) -> None:
        stage, fleet = fault.stage, self.fleet
        link = fleet.links["A"][stage]
        if fault.kind == "kill":
            fleet.restart(stage)
        elif fault.kind == "stop":
            fleet.workers["A"][stage].proc.send_signal(signal.SIGCONT)
        elif fault.kind == "delay":
            time.sleep(0.5)
            link.fault("delay 0")
        elif fault.kind == "blackhole":
            link.fault("blackhole off")
        elif fault.kind == "corrupt":
            link.fault("corrupt 0")

    def bad_expectation(self, fault: Fault, out: Outcome) -> None:
        """A request with a stale epoch or a prefix hash that is not the stage's: refused with
        FAILED_PRECONDITION at once, the stage's own sessions untouched."""
        worker = self.fleet.workers["A"][0]
        stub = pb_grpc.ShardServiceStub(grpc.insecure_channel(worker.address))  # type: ignore[no-untyped-call]
        session = 7_000_000 + fault.index
        tokens = self.pool[0][:8]

        def send(epoch: int, n_past: int, prefix: int, ids: list[int]) -> grpc.StatusCode:
            request = pb.ForwardRequest(
                session_id=session,
                expect=pb.CacheExpectation(epoch=epoch, n_past=n_past, prefix_hash=prefix),
                token_ids=ids,
            )
            try:
                list(stub.Forward(iter([request]), timeout=10))
                return grpc.StatusCode.OK
            except grpc.RpcError as exc:
                return exc.code()

        t0 = time.monotonic()
        send(2, 0, FNV_OFFSET, tokens)  # the session at epoch 2, 8 tokens
        if fault.kind == "stale_epoch":
            code = send(1, 8, prefix_hash(tokens), [5])
        else:
            code = send(2, 8, prefix_hash([1, 2, 3]), [5])
        out.detect_s = round(time.monotonic() - t0, 3)
        out.named_stage = 0
        out.code = code.name
        out.detected = code == grpc.StatusCode.FAILED_PRECONDITION
        stub.CloseSession(pb.CloseSessionRequest(session_id=session), timeout=10)

    def vanishing_client(self, out: Outcome) -> None:
        """A client that reads two tokens and drops its connection: every stage frees the
        session within the bound."""
        addresses = [link.address for link in self.fleet.links["A"]]
        channel = grpc.insecure_channel(addresses[0])
        stub = pb_grpc.ShardServiceStub(channel)  # type: ignore[no-untyped-call]
        request = pb.ForwardRequest(
            session_id=8_000_000 + out.index,
            expect=pb.CacheExpectation(epoch=1, prefix_hash=FNV_OFFSET),
            token_ids=self.pool[1],
            route=pb.RouteSpec(stages=addresses, stage_index=0),
            last_chunk=True,
            max_tokens=10_000,
        )
        before = sum(self.fleet.sessions("A"))
        requests: queue.Queue[pb.ForwardRequest | None] = queue.Queue()
        requests.put(request)
        call = stub.Forward(iter(requests.get, None), timeout=60)
        next(call)
        t0 = time.monotonic()
        channel.close()  # gone mid-stream, as a client process that dies
        requests.put(None)
        out.named_stage = 0
        while time.monotonic() - t0 < DEADLINE_S:
            if sum(self.fleet.sessions("A")) <= before:
                out.detected = True
                out.detect_s = round(time.monotonic() - t0, 3)
                return
            time.sleep(0.05)
        out.detected = False

    def settle(self, out: Outcome) -> None:
        """Between faults: every stage of both routes holds no session (nothing leaked)."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if sum(self.fleet.sessions("A")) + sum(self.fleet.sessions("B")) == 0:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)
        out.problems.append("sessions left on a stage after the cycle")


def summarize(outcomes: list[Outcome], seed: int, wall: float) -> dict[str, Any]:
    errors = [o for o in outcomes if o.detected is not None]
    times = sorted(o.detect_s for o in errors if o.detect_s is not None and o.detected)

    def pct(q: float) -> float | None:
        return times[min(len(times) - 1, int(q * len(times)))] if times else None

    sessions = sum(o.sessions for o in outcomes)
    return {
        "seed": seed,
        "faults_injected": len(outcomes),
        "faults_by_kind": {k: sum(1 for o in outcomes if o.kind == k) for k in KINDS},
        "faults_expecting_an_error": len(errors),
        "faults_detected": sum(1 for o in errors if o.detected),
        "detect_p50_s": statistics.median(times) if times else None,
        "detect_p99_s": pct(0.99),
        "deadline_s": DEADLINE_S,
        "sessions": sessions,
        "sessions_identical": sum(o.identical for o in outcomes),
        "sessions_hung": sum(o.hung for o in outcomes),
        "sessions_lost": sum(o.lost for o in outcomes),
        "untouched_route_errors": sum(o.untouched_errors for o in outcomes),
        "failed_faults": [o.index for o in outcomes if o.problems],
        "wall_s": round(wall, 1),
    }


def run(seed: int, n_faults: int, only: int | None = None) -> tuple[dict[str, Any], list[Outcome]]:
    from dgr_artifacts.models import model_path

    faults = schedule(seed, n_faults)
    if only is not None:
        faults = [faults[only]]
    fleet = Fleet(model_path("smollm2-135m-q4_1"))
    t0 = time.monotonic()
    outcomes: list[Outcome] = []
    try:
        chaos = Chaos(fleet, seed)
        for fault in faults:
            outcome = chaos.cycle(fault)
            outcomes.append(outcome)
            status = "ok" if not outcome.problems else "; ".join(outcome.problems)
            print(
                f"fault {fault.index:3d} {fault.kind:13s} stage {outcome.stage} "
                f"detect {outcome.detect_s} named {outcome.named_stage} {outcome.code}: {status}",
                flush=True,
            )
    finally:
        fleet.stop()
    return summarize(outcomes, seed, time.monotonic() - t0), outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dgr_cert.chaos")
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--faults", type=int, default=216)
    parser.add_argument("--only", type=int, help="replay fault I of the seed's schedule alone")
    parser.add_argument("--out", default="evidence/chaos/chaos.json")
    args = parser.parse_args(argv)
    summary, outcomes = run(args.seed, args.faults, args.only)
    print(json.dumps(summary, indent=2))
    if args.only is None:
        out = find_root().root / args.out
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps(
                {
                    "measured_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "summary": summary,
                    "faults": [asdict(o) for o in outcomes],
                },
                indent=1,
            )
            + "\n"
        )
        report("chaos", {k: v for k, v in summary.items() if isinstance(v, int | float)})
    ok = not summary["failed_faults"]
    if not ok:
        print(
            f"failed faults {summary['failed_faults']}: "
            f"reproduce one with --seed {args.seed} --only I"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
