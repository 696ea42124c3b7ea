"""A training script that reports what no honest one would, for the tests of what the tuner
reads from a trial (all of it untrusted): no torch, so it starts in a fraction of a second.

    python hostile.py --behave KIND [--only-batch N]

Each step sleeps 10 ms (the "training"); the script reports the config's batch
(micro-batch x accumulation) unless KIND says otherwise. With --only-batch N it misbehaves only
when the candidate's micro-batch is not N, so that a study's baseline measures and the next
trials misbehave.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

import autotune


def raw(folder: str, doc: dict[str, object]) -> None:
    """A line written into the step file without autotune.step(): what a hostile or broken
    script could put there."""
    with open(os.path.join(folder, "steps.rank0.jsonl"), "a") as f:
        f.write(json.dumps(doc) + "\n")


# Lines no autotune.step() writes, for --behave KEY: nesting that Python's parser recurses into
# (200,000 levels once ended the tuner; 5,000 fit in a line's length), a read-back whose tables
# are lists, and 1 MiB with no line end (300 MB of it grew the tuner to 640 MB).
LINES = {
    "deep-array": "[" * 200_000 + "]" * 200_000 + "\n",
    "deep-object": '{"k": ' * 5_000 + "1" + "}" * 5_000 + "\n",
    "list-readback": json.dumps({"k": {"via": "Trainer", "fixed": ["amp"]}}) + "\n",
    "no-line-end": "x" * (1 << 20),
}

# Progress events that once ended the run: a kind without its numbers (the console formats
# them), keys the --json events use themselves ("trial", "kind"), a number that is text.
PROGRESS = [{"event": "built"}, {"event": "x", "trial": 1, "kind": "y"},
            {"event": "window", "trial": 1, "kind": "y", "index": 0, "samples": 1,
             "seconds": 1.0, "samples_per_sec": 1.0},
            {"event": "warmup_step", "seconds": "slow"}]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--behave", default="ok")
    parser.add_argument("--only-batch", type=int, default=0)
    parser.add_argument("--steps", type=int, default=100_000)
    args = parser.parse_args()
    behave = args.behave
    if behave == "chdir-before":
        os.chdir(tempfile.mkdtemp())
    if behave == "bad-rank":
        os.environ["RANK"] = "abc"
    if behave == "bad-samples-env":
        os.environ["AUTOTUNE_SAMPLES_PER_STEP"] = "abc"
    profile = autotune.load_profile()
    if args.only_batch and profile.micro_batch_size == args.only_batch:
        behave = "ok"
    if behave == "chdir-after":
        os.chdir(tempfile.mkdtemp())
    if behave == "loud":
        line = "x" * 1023 + "\n"
        for _ in range(50 * 1024):  # 50 MiB on stdout
            sys.stdout.write(line)
        sys.stdout.flush()
    batch = profile.micro_batch_size * profile.accumulation_steps
    folder = os.environ.get("AUTOTUNE_TRIAL_DIR", "")
    if behave == "children":
        # A forked child and a spawned one, alive through the trial: loader workers' kinds.
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        import multiprocessing

        multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,),
                                                     daemon=True).start()
    frozen = 0.0
    for step in range(1, args.steps + 1):
        time.sleep(0.01)
        if behave == "rmdir-self" and step == 4:
            # A file written into it meanwhile fails one rmtree (Directory not empty, exit 1
            # under a loaded CI run): removed until it is gone, as the behaviour says.
            for _ in range(100):
                shutil.rmtree(folder, ignore_errors=True)
                if not os.path.exists(folder):
                    break
                time.sleep(0.01)
        if behave == "nan-time" and step == 5:
            raw(folder, {"s": step, "t": math.nan, "n": batch})
            time.sleep(60)
        elif behave == "frozen-time" and step >= 2:
            # Every step "ends" at the same instant: a rate with a zero in the denominator.
            raw(folder, {"s": step, "t": frozen, "n": batch})
        elif behave == "spike":
            autotune.step(10**9 if step % 10 == 0 else batch)
        elif behave == "default-then-big":
            autotune.step() if step == 1 else autotune.step(10**9)
        elif behave == "nan-wait" and step == 3:
            autotune.step(batch, data_s=math.nan)
        elif behave == "nan-loss":
            autotune.step(batch, loss=math.nan if step >= 5 else 0.5)
        elif behave == "junk-progress" and step == 5:
            # The folder is the script's: events no trial writes, in the tuner's progress file.
            with open(os.path.join(folder, "progress.jsonl"), "a") as f:
                for event in PROGRESS:
                    f.write(json.dumps(event) + "\n")
            autotune.step(batch)
        elif behave in LINES and step == 5:
            with open(os.path.join(folder, "steps.rank0.jsonl"), "a") as f:
                f.write(LINES[behave])
            time.sleep(60)
        elif behave == "nested" and step == 5:
            # A second training process of this rank: a python the script starts, and waits
            # for (the next steps reported are the nested one's).
            autotune.step(batch)
            subprocess.run([sys.executable, __file__, "--behave", "ok"], check=False)
        elif behave == "not-json" and step == 5:
            raw(folder, {"s": step, "t": time.time(), "n": batch})
            with open(os.path.join(folder, "steps.rank0.jsonl"), "a") as f:
                f.write("{not json\n")
        else:
            autotune.step(batch)
        if behave == "late-write" and step == 1000:
            # What an unhooked Trainer does after a while: write into the user's folder.
            with open("checkpoint.pt", "w") as f:
                f.write("weights")
        if step == 1:
            frozen = time.time()
        if autotune.should_stop():
            break


if __name__ == "__main__":
    main()
