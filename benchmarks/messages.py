"""What typed messages cost: build, encode and check a request, four ways side by side in one run.

The distributed runtime's requests are `msgspec` structs (checkfree.messages): a sender builds one and turns it
into a header (`to_wire`: builtins, the wire's msgpack codec packs them), a receiver checks the decoded header
and gets the struct back (`check_request`: every field's type, nested ones too). Three alternatives are timed
beside it, each on the same messages:

* dict: the header as a plain dict checked by hand, as before the typed messages (a `require` of the top-level
  fields' types, nested fields not checked at all);
* msgspec: `to_wire` + `check_request` (the runtime's path);
* pydantic: a `BaseModel` per message, `model_dump` + `model_validate` (strict, as msgspec is);
* msgspec codec: msgspec's own msgpack encoder and typed decoder end to end (bytes in, struct out), against
  `msgpack.packb` / `unpackb` of the dict: what replacing the wire's codec would add on top.

Messages: FORWARD (a pass: the hot path, 2 x microbatches per stage and step), RUN_STEP of 8 microbatches over 4
stages with their routes, and ASSIGN recover (a nested plan). Each row is the median of `--rounds` rounds of
`--n` calls, in microseconds per message, and its ratio to the dict path measured in the same run.

    python -m benchmarks.messages            # 7 rounds of 20000
    python -m benchmarks.messages --quick    # 3 rounds of 2000
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any, Literal

import msgpack
import msgspec
import pydantic

from checkfree.messages import AssignRecover, Forward, Request, RunStep, check_request, request
from checkfree.protocol import RPC, ProtocolError
from checkfree.recovery import Neighbours

__all__ = ["main", "measure"]

RUN = "bench"


def _samples() -> dict[str, Request]:
    routes = [[0, 1, 2, 3] if mb % 2 == 0 else [1, 0, 3, 2] for mb in range(8)]
    return {
        "forward": Forward(step=120, attempt=0, mb=3, hop=2),
        "run_step": RunStep(step=120, attempt=0, evaluate=False, peers={s: f"12D3KooWpeer{s:040d}" for s in range(4)},
                            routes=routes),
        "assign_recover": AssignRecover(stage=2, step=120, plan=Neighbours(stage=2, method="average", sources=(1, 3)),
                                        sources={1: "12D3KooWpeer1", 3: "12D3KooWpeer3"}),
    }


# ---- the dict path, as it was: top-level fields checked by hand -----------------------------------------
_FIELDS = {RPC.FORWARD: {"run": str, "step": int, "attempt": int, "mb": int, "hop": int},
           RPC.RUN_STEP: {"run": str, "step": int, "attempt": int, "peers": dict, "evaluate": bool},
           RPC.ASSIGN: {"run": str, "stage": int, "mode": str}}


def _require(header: dict, types: dict[str, type]) -> None:
    for name, typ in types.items():
        if name not in header:
            raise ProtocolError(f"request is missing field {name!r}")
        value = header[name]
        if not isinstance(value, typ) or (isinstance(value, bool) and typ is int):
            raise ProtocolError(f"field {name!r} must be {typ.__name__}, got {type(value).__name__}")


def _as_dict(message: Request) -> dict:
    return {"run": RUN, **msgspec.to_builtins(message, str_keys=True)}


# ---- pydantic models of the same messages ---------------------------------------------------------------
class _Strict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(strict=True, frozen=True)


class PForward(_Strict):
    run: str
    step: int
    attempt: int
    mb: int
    hop: int
    sent: float | None = None


class PRunStep(_Strict):
    run: str
    step: int
    attempt: int
    evaluate: bool
    peers: dict[str, str]
    routes: list[list[int]] | None = None


class PNeighbours(_Strict):
    stage: int
    method: str
    sources: list[int]
    edge_sources: dict[str, int] = {}
    edges_reinit: list[str] = []
    fallback: str | None = None
    reason: str = ""


class PAssignRecover(_Strict):
    run: str
    mode: Literal["recover"]
    stage: int
    plan: PNeighbours
    sources: dict[str, str]
    step: int


_PYDANTIC = {"forward": PForward, "run_step": PRunStep, "assign_recover": PAssignRecover}


def _ways(name: str, message: Request) -> dict[str, Callable[[], Any]]:
    rpc, plain = message.rpc, msgpack.unpackb(msgpack.packb(_as_dict(message)))  # as a receiver decodes it
    model = _PYDANTIC[name].model_validate(plain)
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(type(message))

    def by_dict() -> Any:
        header = dict(plain)  # the sender builds it
        _require(header, _FIELDS[rpc])
        return header

    def by_msgspec() -> Any:
        return check_request(rpc, request(RUN, message))

    def by_pydantic() -> Any:
        return type(model).model_validate(model.model_dump())

    def dict_codec() -> Any:
        header = msgpack.unpackb(msgpack.packb(dict(plain)), strict_map_key=False)
        _require(header, _FIELDS[rpc])
        return header

    def msgspec_codec() -> Any:
        return decoder.decode(encoder.encode(message))

    return {"dict": by_dict, "msgspec": by_msgspec, "pydantic": by_pydantic, "dict + msgpack": dict_codec,
            "msgspec codec": msgspec_codec}


def measure(rounds: int, n: int) -> dict[str, dict[str, float]]:
    """Microseconds per message of each way, by message: the median of `rounds` rounds of `n` calls, the ways
    interleaved round by round."""
    out: dict[str, dict[str, float]] = {}
    for name, message in _samples().items():
        ways = _ways(name, message)
        times: dict[str, list[float]] = {w: [] for w in ways}
        for _ in range(rounds):
            for w, fn in ways.items():
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                times[w].append((time.perf_counter() - t0) / n * 1e6)
        out[name] = {w: statistics.median(ts) for w, ts in times.items()}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 rounds of 2000 calls")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--n", type=int, default=20000)
    args = p.parse_args(argv)
    rounds, n = (3, 2000) if args.quick else (args.rounds, args.n)
    result = measure(rounds, n)
    print(f"load average {os.getloadavg()[0]:.2f}; median of {rounds} rounds of {n} calls; us per message "
          "(ratio to dict)")
    ways = list(next(iter(result.values())))
    print(f"{'message':16}" + "".join(f"{w:>22}" for w in ways))
    for name, row in result.items():
        base = row["dict"]
        print(f"{name:16}" + "".join(f"{row[w]:>13.2f} ({row[w] / base:4.1f}x)" for w in ways))


if __name__ == "__main__":
    main()
