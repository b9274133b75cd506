"""One rank of a training run with an injected fault (megacore.train's own entry, plus a step callback).
argv: recipe path. Environment: FAULT_KIND (raise | kill | sigterm | hang | oom | none; hang: the rank stops in
its step callback for good, so its peers wait for it in the next collective; oom: the rank's GPU gets a memory
limit of what it holds now, so its next step runs out of memory), FAULT_RANK, FAULT_STEP; the fault
fires only in the first attempt of a job (MEGACORE_RESTART unset or 0), so a restarted job runs clean.
FAULT_STEP_DELAY: seconds every rank sleeps after each step (a window for a test to act in).
FAULT_KIND=slow_report: rank FAULT_RANK's error report to the launcher (if it fails) is written 1.5 s late."""

import os
import signal
import sys
import time

from megacore import train

kind = os.environ.get("FAULT_KIND", "none")
fault_rank = int(os.environ.get("FAULT_RANK", "0"))
fault_step = int(os.environ.get("FAULT_STEP", "1"))
delay = float(os.environ.get("FAULT_STEP_DELAY", "0"))
first_attempt = int(os.environ.get("MEGACORE_RESTART", "0") or 0) == 0
world = []

if kind == "slow_report" and first_attempt:
    from megacore import _proc

    if _proc.rank_from_env() == fault_rank:
        report = _proc.report_error

        def late_report(*args, **kwargs):
            time.sleep(1.5)
            report(*args, **kwargs)

        _proc.report_error = late_report


def on_step(m):
    if delay:
        time.sleep(delay)
    if not first_attempt or m["step"] != fault_step or world[0].rank != fault_rank:
        return
    if kind == "raise":
        raise RuntimeError(f"injected failure at step {m['step']}")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
    if kind == "oom":
        import megacore as mc

        dev = f"cuda:{int(os.environ.get('LOCAL_RANK', '0')) % mc.cuda_device_count()}"  # the trainer's choice
        mc.synchronize(dev)
        mc.empty_cache(dev)  # no cached blocks to serve the next step: it has to reserve, and cannot
        mc.set_memory_limit(dev, max(mc.memory_stats(dev)["allocated"], 1))
    if kind == "hang":
        while True:
            time.sleep(3600)


def body(on_world):
    def keep(w):
        world.append(w)
        on_world(w)
    train.run(train._load(sys.argv[1], []), on_step=on_step, on_world=keep)


sys.exit(train.guarded(body))
