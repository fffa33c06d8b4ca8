"""What a signed pipeline spec costs (agent.signing; docs/security.md, "Signed pipeline specs").

Per spec, in microseconds (median of `--repeat` rounds of `--n` calls each):
- sign: what `fogctl deploy` / `fog-agent deploy` adds once per deploy (the statement + Ed25519);
- verify: what an agent adds to each spec it admits (a spawn, a copy, a re-home, a re-adoption)
  and to each retained pipeline record it reads: `SpecTrust.check` on the wire form
  (`extra["signature"]`), i.e. parsing the field, the statement and the Ed25519 verification;
- baseline: `load_pipeline_text` of the same text, which admission already does for every spec.
The data path is not signed: nothing here runs per record or per batch.

Run: .venv/bin/python benchmarks/bench_signing.py [--n 2000] [--repeat 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent import signing  # noqa: E402
from agent.config import load_pipeline_text  # noqa: E402

PIPELINE = (ROOT / "examples" / "demo-pipeline.toml")


def _per_call_us(fn, n: int, repeat: int) -> float:
    rounds = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        rounds.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(rounds)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000, help="calls per round")
    ap.add_argument("--repeat", type=int, default=5, help="rounds (the median is printed)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    text = PIPELINE.read_text()
    with tempfile.TemporaryDirectory() as d:
        signing.generate_keypair(Path(d) / "admin.key", Path(d) / "admin.pub")
        signer = signing.load_signer(Path(d) / "admin.key")
        verifier = signing.load_verifier([Path(d) / "admin.pub"])
    name = load_pipeline_text(text).pipeline.name
    wire = signer.sign(name, "g1", text).to_extra()
    trust = signing.SpecTrust(verifier)
    assert trust.check(name, "g1", text, wire) is None
    out = {
        "text_bytes": len(text.encode()),
        "sign_us": _per_call_us(lambda: signer.sign(name, "g1", text), args.n, args.repeat),
        "verify_us": _per_call_us(lambda: trust.check(name, "g1", text, wire), args.n, args.repeat),
        "parse_pipeline_us": _per_call_us(lambda: load_pipeline_text(text), args.n, args.repeat),
        "n": args.n, "repeat": args.repeat,
    }
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
    else:
        print(f"pipeline text {out['text_bytes']} bytes ({PIPELINE.name}); median of {args.repeat} x {args.n} calls")
        print(f"sign   {out['sign_us']:8.1f} us per spec (once per deploy)")
        print(f"verify {out['verify_us']:8.1f} us per spec (each admitted spec, each pipeline record read)")
        print(f"parse  {out['parse_pipeline_us']:8.1f} us per spec (load_pipeline_text, admission's baseline)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
