"""Run the single-process hostile scenarios, one child process each, and print the verdict table.

    python scripts/hostile/single/run.py [names...] [--timeout 90] [--json out.json]

Verdicts: EXACT-REPLAYED (bitwise, some calls replayed), EXACT-EAGER(reasons) (bitwise, nothing
replayed), CLEAR-ERROR (a ReplayError), SILENT-DIFF(what differs), CRASH (another exception only
under replay), SCENARIO-BROKEN (eager itself failed), TIMEOUT.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path[:0] = [str(HERE), str(ROOT)]  # this tree's replaykit, not an installed one


def one(name: str) -> dict:
    import scenarios  # noqa: F401 - fills the registry
    from harness import REGISTRY, diff, run_mode

    entry = REGISTRY[name][0]
    eager, eerr, _, _ = run_mode(name, "eager")
    rep, rerr, info, warns = run_mode(name, "replay")
    out = {"name": name, "entry": entry, "info": info, "warnings": warns}
    c = info.get("counts", {})
    if eerr:
        out["verdict"] = f"SCENARIO-BROKEN({eerr[:120]})"
    elif rerr:
        kind = "CLEAR-ERROR" if rerr.startswith("ReplayError") else "CRASH"
        out["verdict"] = f"{kind}({rerr[:200]})"
    else:
        d = diff(eager, rep)
        if d:
            out["verdict"] = f"SILENT-DIFF({len(d)}: {', '.join(d[:4])})"
        elif c.get("replay", 0) > 0:
            out["verdict"] = "EXACT-REPLAYED"
        else:
            why = ", ".join(f"{k}x{v}" for k, v in info.get("reasons", {}).items())
            ret = "; ".join(info.get("retired", []))
            out["verdict"] = f"EXACT-EAGER({why}{' | retired: ' + ret if ret else ''})"
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["--one"]:
        print("@@" + json.dumps(one(argv[1])))
        return 0
    timeout, js = 90.0, None
    names = []
    it = iter(argv)
    for a in it:
        if a == "--timeout":
            timeout = float(next(it))
        elif a == "--json":
            js = next(it)
        else:
            names.append(a)
    import scenarios  # noqa: F401
    from harness import REGISTRY

    names = names or list(REGISTRY)
    rows = []
    for n in names:
        t0 = time.time()
        try:
            p = subprocess.run(
                [sys.executable, __file__, "--one", n],
                capture_output=True,
                text=True,
                timeout=timeout,
                cwd=ROOT,
            )
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("@@")]
            if line:
                r = json.loads(line[-1][2:])
            else:
                r = {"name": n, "entry": REGISTRY[n][0], "info": {}, "warnings": [],
                     "verdict": f"CRASH(child rc {p.returncode}: {p.stderr.strip()[-200:]})"}  # fmt: skip
        except subprocess.TimeoutExpired:
            r = {"name": n, "entry": REGISTRY[n][0], "info": {}, "warnings": [],
                 "verdict": f"TIMEOUT({timeout:.0f}s)"}  # fmt: skip
        r["secs"] = round(time.time() - t0, 1)
        rows.append(r)
        c = r["info"].get("counts", {})
        cnt = f"rec {c.get('record', 0)} rep {c.get('replay', 0)} eag {c.get('eager', 0)}"
        reasons = ",".join(f"{k}x{v}" for k, v in r["info"].get("reasons", {}).items())
        print(f"{n:34s} {r['entry']:10s} {cnt:22s} {r['secs']:5.1f}s {r['verdict'][:150]}"
              f"{'  [' + reasons[:80] + ']' if reasons and 'EAGER' not in r['verdict'] else ''}",
              flush=True)  # fmt: skip
    if js:
        Path(js).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
