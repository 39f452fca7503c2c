"""The store protocol: the keys of a job's TCPStore, signing, blobs, and the notices that wake readers.

One store per job, hosted by the driver. Everything the processes of a job tell
each other outside the training collectives goes through it:

    job/...            the job's pieces (signed), script path, model digest, version
    events/<k>         device -> coordinator messages (announce, ready, formed, failure, bye)
                       and CLI -> coordinator requests (scale), in order
    gen/latest, gen/<G> the published generations: members in rank order, who joined/left/failed
    gen/<G>/pg/...     the PrefixStore under which generation G's process group forms
    reply/<device>     the coordinator's word to one device (refused, evicted)
    answer/<request>   the coordinator's answer to a scale request (accepted or refused, why)
    finish             stop training cleanly after the step in flight (SIGTERM to the driver)
    heartbeat/<device> a counter each device bumps; a remote device that stops bumping is dead
    metrics/<k>        per-step and event records from rank 0, read by the driver
    acknowledged       the last step whose records the driver delivered (the devices forget those)
    result/...         the final training state (signed), written by rank 0
    driver/instance    what the driver says about itself (pid, host, start, whether it re-adopts
                       devices that outlived the driver before it: started with --resume)
    error, stop, status

Values larger than the store's message limit travel as chunked blobs. Blobs
that are unpickled (the job) or loaded (state) carry an HMAC made with the
job's secret, and joiners prove they hold the secret, because TCPStore itself
authenticates nobody.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from typing import Callable

CHUNK_BYTES = 4 << 20  # the libuv TCPStore refuses messages above 8 MiB


def sign(secret: str, *parts: bytes) -> str:
    mac = hmac.new(secret.encode(), digestmod=hashlib.sha256)
    for part in parts:
        mac.update(part)
    return mac.hexdigest()


def scale_proof(secret: str, request) -> str:
    """What a scale request presents: the secret's HMAC over the request (with its id)."""
    return sign(secret, b"scale:", json.dumps(request, sort_keys=True).encode())


def join_proof(secret: str, device_id: str, salt: str) -> str:
    """What a joiner presents: proof that it knows the secret, bound to its id."""
    return sign(secret, b"join:", device_id.encode(), b":", salt.encode())


def secret_check(secret: str, salt: str) -> str:
    """What the driver publishes (`job/secret_check`) so that `flexpar join` can tell a wrong secret in
    one line before it starts a device: the secret's HMAC over the job's salt (it reveals the secret no
    more than the signed payload does)."""
    return sign(secret, b"secret-check:", salt.encode())


def adopt_proof(secret: str, device_id: str, salt: str) -> str:
    """What a device that outlived its driver presents to the restarted one (whose salt is new): proof
    that it knows the secret, bound to its id; a join proof cannot be replayed as one."""
    return sign(secret, b"adopt:", device_id.encode(), b":", salt.encode())


# What a driver says about itself, written last when it starts (with `tell_devices`): its process,
# and whether it re-adopts devices that outlived the driver before it (started with --resume).
DRIVER_KEY = "driver/instance"
# The step up to which the driver delivered every record (flexpar.core.delivery); the devices read it
# at their follower's pace and forget the records they kept up to it. Not a notice: nobody waits for it.
ACKNOWLEDGED_KEY = "acknowledged"

# The "stop" a driver tells once the job ended well (rank 0 handed the result over): only devices still
# on their way are there to read it, and they leave quietly (flexpar/worker/process.py).
JOB_ENDED = "the job ended"


def put_blob(store, key: str, data: bytes, secret: str) -> None:
    """Store `data` under `key` in chunks, with an HMAC over the whole."""
    chunks = [data[i : i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)] or [b""]
    for index, chunk in enumerate(chunks):
        store.set(f"{key}/{index}", chunk)
    meta = {"chunks": len(chunks), "size": len(data), "mac": sign(secret, data)}
    store.set(f"{key}/meta", json.dumps(meta))


def get_blob(store, key: str, secret: str) -> bytes:
    """The blob under `key`; raises ValueError if its HMAC does not match the secret."""
    meta = json.loads(store.get(f"{key}/meta"))
    data = b"".join(store.get(f"{key}/{index}") for index in range(meta["chunks"]))
    if len(data) != meta["size"] or not hmac.compare_digest(sign(secret, data), meta["mac"]):
        raise ValueError(
            f"the data under '{key}' is not signed with this job's secret: "
            "check the secret you passed (FLEXPAR_SECRET or --secret-file)"
        )
    return data


def get_json(store, key: str):
    return json.loads(store.get(key))


def has(store, key: str) -> bool:
    return store.check([key])


# The driver's counterpart of NOTICE_KEY (below): every channel message, and the key
# "done", bump it after they are written, so the driver's loop reads one counter per
# pass and its channels only when it moved (driver_loop.DriverLoop.run). They then set
# DRIVER_WAKE_KEY, which a thread of the driver waits for in the store (driver/waker.py):
# the driver's loop sleeps until something was sent, instead of polling the store 100
# times a second on cores that compute.
DRIVER_NOTICE_KEY = "driver/notice"
DRIVER_WAKE_KEY = "driver/wake"


def wake_driver(store) -> None:
    """Have the driver's loop look at what was just written (the counter first, then the wake-up)."""
    store.add(DRIVER_NOTICE_KEY, 1)
    store.set(DRIVER_WAKE_KEY, "1")


def tell_driver(store, key: str, value: str) -> None:
    """Set `key` for the driver (as "done") and wake its loop."""
    store.set(key, value)
    wake_driver(store)


# Devices follow a few keys: gen/latest, gen/<G>/dead, stop, finish, speed/<device>,
# reply/<device> and SCHEDULE_HOLD_KEY. Whoever writes one of them does so with `tell_devices`, which then
# bumps NOTICE_KEY: a follower reads that one counter per poll, and the keys only when
# it moved. Reading them all at every poll took seven store round trips, 50 times a
# second; each wakes a thread in the worker and the store's thread in the driver, and
# where every core computes (one CPU device takes them all) each wake-up preempts a
# compute thread, whose OpenMP team then waits for it. (A one-device job's overhead
# against a plain accumulation loop turned out to be page faults, not these wake-ups:
# worker/process.py, keep_freed_memory.) A follower still reads every key each FOLLOW_ALL_S,
# so a writer that does not tell is seen late, not never.
NOTICE_KEY = "devices/notice"

# The step of the first scheduled leave the driver has not decided and published yet (-1: none),
# a key devices follow (flexpar/core/schedule.py, ScheduleTracker.hold): at the boundary before that
# step the members wait until it moves on, so that the leave takes effect there, whatever the step time.
SCHEDULE_HOLD_KEY = "schedule/hold"


def tell_devices(store, key: str, value: str) -> None:
    """Set `key`, one of the keys devices follow, and have their followers read it (NOTICE_KEY)."""
    store.set(key, value)
    store.add(NOTICE_KEY, 1)


def meet(store, key: str, count: int, problem: Callable[[], str] = lambda: "", poll_s: float = 0.0005) -> str:
    """Arrive at `key` in the store and wait until `count` members have: "" then, or `problem()`'s
    first non-empty answer (why the meeting cannot complete), asked between polls.

    Every member of a new generation meets so before it forms the generation's
    process group (`DeviceLink.gather`): forming a gloo group waits inside C++,
    where a member's death shows only at the timeout, while here it shows at
    once. benchmarks/sim_validation.py's probe meets the same way.
    """
    store.add(key, 1)
    while store.add(key, 0) < count:
        why = problem()
        if why:
            return why
        time.sleep(poll_s)
    return ""
