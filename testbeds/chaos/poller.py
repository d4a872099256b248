"""``python -m testbeds.chaos.poller``: ask the coordinator for a job's status once a second.

Runs on the testbed's first host (where ``fusion status`` would run). Each poll is one
``GetJob`` call, no retries, with a deadline; it prints one JSON line: the wall time ``t``,
``ok``, ``latency_s``, the error if any, and on success the job's ``state``, ``step``,
``loss`` and the job events not printed before. The chaos harness reads these lines for
its liveness figures and for what the job did about each event.

The channel reconnects at most :data:`RECONNECT_BACKOFF_MS` after a failed connection
(gRPC's default backoff grows to minutes): a ``fusion status`` run once a second dials
afresh each time, and the poller must not report a restarted coordinator later than that
would.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import grpc

from fusion.auth import AUTH_METADATA
from fusion.tls import open_channel
from fusion.wire import coordinator_pb2 as cpb
from fusion.wire import coordinator_pb2_grpc as cgrpc

#: The longest wait between the channel's connection attempts (the poll interval).
RECONNECT_BACKOFF_MS = 1000
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
    ("grpc.use_local_subchannel_pool", 1),
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m testbeds.chaos.poller", description=__doc__.splitlines()[0])
    p.add_argument("--coordinator", required=True, help="HOST:PORT")
    p.add_argument("--job", required=True, help="job id")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between polls")
    p.add_argument("--deadline", type=float, default=5.0, help="seconds a call may take")
    args = p.parse_args(argv)
    token = os.environ.get("FUSION_TOKEN", "")
    channel = open_channel(args.coordinator, options=CHANNEL_OPTIONS)
    stub = cgrpc.CoordinatorStub(channel)
    seen: set[tuple[float, str, str]] = set()
    while True:
        t0 = time.time()
        start = time.perf_counter()
        rec: dict = {"t": t0}
        try:
            resp = stub.GetJob(
                cpb.GetJobRequest(job_id=args.job), timeout=args.deadline, metadata=((AUTH_METADATA, token),)
            )
            status = json.loads(resp.status_json)
            rec.update(ok=True, state=status["state"], step=status["step"], loss=status.get("loss"))
            rec["reason"] = status.get("reason")
            new = []
            for e in status.get("events", []):
                key = (float(e.get("time", 0.0)), str(e.get("event")), str(e.get("message")))
                if key not in seen:
                    seen.add(key)
                    new.append(e)
            rec["events"] = new
        except grpc.RpcError as e:
            rec.update(ok=False, error=f"{e.code().name}: {e.details()}")  # type: ignore[attr-defined]
        rec["latency_s"] = round(time.perf_counter() - start, 4)
        print(json.dumps(rec), flush=True)
        time.sleep(max(0.0, args.interval - (time.time() - t0)))


if __name__ == "__main__":
    sys.exit(main())
