"""`memproxy init`: a starting config per provider that `check-config` accepts and `serve` runs,
written without litellm and never over an existing file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fake_upstream import FakeUpstream
from memproxy.starter import PROVIDERS
from processes import clean_env, memproxy_command, serve_one

# The keys the starting configs read from the environment, as a user would have set them.
KEYS = {"OPENAI_API_KEY": "sk-test", "ANTHROPIC_API_KEY": "sk-ant-test"}


def run(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*memproxy_command(), *args], capture_output=True, text=True, timeout=60,
                          cwd=cwd, env=clean_env(**env))


@pytest.mark.parametrize("provider", PROVIDERS)
def test_each_providers_starting_config_passes_check_config(tmp_path: Path, provider: str) -> None:
    written = run("init", "--provider", provider, "-o", "memproxy.yaml", cwd=tmp_path)
    assert written.returncode == 0, written.stderr
    assert "memproxy.yaml" in written.stdout
    text = (tmp_path / "memproxy.yaml").read_text()
    assert text.startswith("# memproxy configuration for ")
    checked = run("check-config", "-c", "memproxy.yaml", cwd=tmp_path, **KEYS)
    assert checked.returncode == 0, checked.stderr
    assert "1 models" in checked.stdout
    if provider in ("ollama", "vllm"):  # a window litellm does not know is written in
        assert "\n    context_window: 8192 " in text


def test_a_key_left_unset_is_named_by_check_config(tmp_path: Path) -> None:
    assert run("init", cwd=tmp_path).returncode == 0  # openai to memproxy.yaml by default
    checked = run("check-config", "-c", "memproxy.yaml", cwd=tmp_path)
    assert checked.returncode == 2
    assert "models[0].api_key: environment variable OPENAI_API_KEY is not set" in checked.stderr


def test_init_never_overwrites_unless_forced(tmp_path: Path) -> None:
    (tmp_path / "memproxy.yaml").write_text("# mine\n")
    refused = run("init", "--provider", "ollama", cwd=tmp_path)
    assert refused.returncode == 1
    assert "memproxy.yaml exists; --force overwrites it" in refused.stderr
    assert (tmp_path / "memproxy.yaml").read_text() == "# mine\n"
    forced = run("init", "--provider", "ollama", "--force", cwd=tmp_path)
    assert forced.returncode == 0, forced.stderr
    assert "model: openai/llama3.2" in (tmp_path / "memproxy.yaml").read_text()


def test_init_to_standard_output(tmp_path: Path) -> None:
    printed = run("init", "--provider", "vllm", "-o", "-", cwd=tmp_path)
    assert printed.returncode == 0, printed.stderr
    assert "vLLM" in printed.stdout.splitlines()[0]
    assert list(tmp_path.iterdir()) == []


def test_init_does_not_import_litellm(tmp_path: Path) -> None:
    code = ("import sys; from memproxy.entry import main; assert main(['init', '-o', 'x.yaml']) == 0; "
            "assert 'litellm' not in sys.modules, 'litellm was imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            cwd=tmp_path, env=clean_env())
    assert result.returncode == 0, result.stderr


def test_serve_runs_the_openai_starting_config(tmp_path: Path, upstream: FakeUpstream) -> None:
    """As written, with the OpenAI endpoint taken from OPENAI_BASE_URL (here the fake provider)."""
    assert run("init", cwd=tmp_path).returncode == 0
    served = serve_one(tmp_path / "memproxy.yaml", tmp_path / "stderr.log", cwd=tmp_path,
                       env=clean_env(OPENAI_BASE_URL=upstream.url, OPENAI_API_KEY="sk-from-env"))
    try:
        with served.client(session="starter") as client:
            reply = client.chat.completions.create(model="gpt-4o-mini",
                                                   messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content == "reply 1"
        assert upstream.last().headers["Authorization"] == "Bearer sk-from-env"
    finally:
        assert served.stop() == 0, served.log.read_text()
    assert (tmp_path / "memproxy.db").exists()  # the default store, where memproxy ran
