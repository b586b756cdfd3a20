"""`.dockerignore` sends the Docker daemon what the Dockerfile copies and nothing else (no virtualenv,
no database, no `.git`), read with Docker's rules: each pattern matches a path or a directory above
it, `!` takes a match back, and the last pattern that matches decides."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def sent_to_docker(path: str, patterns: list[str]) -> bool:
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    sent = True
    for pattern in patterns:
        keep = pattern.startswith("!")
        glob = pattern.lstrip("!").rstrip("/")
        if glob.startswith("**/"):
            hit = any(fnmatch.fnmatchcase(part, glob[3:]) for part in parts)
        else:
            hit = any(fnmatch.fnmatchcase(prefix, glob) and prefix.count("/") == glob.count("/")
                      for prefix in prefixes)
        if hit:
            sent = keep
    return sent


def test_the_build_context_holds_what_the_dockerfile_copies_and_nothing_big() -> None:
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    copied = [source for line in (ROOT / "Dockerfile").read_text().splitlines()
              if line.startswith("COPY") for source in re.split(r"\s+", line)[1:-1]]
    assert copied, "the Dockerfile copies nothing?"
    files = [str(p.relative_to(ROOT)) for source in copied for p in
             ([ROOT / source] if (ROOT / source).is_file() else (ROOT / source).rglob("*"))
             if p.is_file() and "__pycache__" not in p.parts]
    assert "memproxy/store/migrations/sqlite/0009_recall.sql" in files
    assert all(sent_to_docker(f, patterns) for f in files), [f for f in files if not sent_to_docker(f, patterns)]
    for left_out in (".venv/bin/python", ".git/HEAD", "memproxy.db", "memproxy.db-wal", "tests/conftest.py",
                     "bench/run.py", "docs/benchmarks.md", "memproxy/__pycache__/cli.cpython-311.pyc",
                     "config.example.yaml"):
        assert not sent_to_docker(left_out, patterns), left_out
