"""Peak RSS of each Ray runner process during a 2-runner CartPole run (40,960 steps), and
whether torch (libtorch) is mapped into it: a runner acts in numpy and should not load it.

    .venv/bin/python benchmarks/runner_memory.py /tmp/runner-memory-run
"""

import sys
import threading
import time
from pathlib import Path

import psutil

from trustrl.config import resolve
from trustrl.run.trainer import Trainer

seen: dict[int, list] = {}
stop = False


def sample():
    while not stop:
        for p in psutil.process_iter(["cmdline"]):
            try:
                if "RunnerActor" in " ".join(p.info["cmdline"] or []):
                    rss = p.memory_info().rss / 2**20
                    torch = "libtorch" in Path(f"/proc/{p.pid}/maps").read_text()
                    old = seen.get(p.pid, [0.0, False])
                    seen[p.pid] = [max(old[0], rss), old[1] or torch]
            except (psutil.Error, OSError):
                pass
        time.sleep(0.2)


t = threading.Thread(target=sample, daemon=True)
t.start()
config = resolve("CartPole-v1", overrides={"runners": {"count": 2}, "total_steps": 40960})
Trainer(config, sys.argv[1], overwrite=True).train()
stop = True
t.join()
print(
    "runner processes: peak RSS MiB, torch mapped:",
    {k: (round(v[0]), v[1]) for k, v in seen.items()},
)
