"""Token counts calibrated by what each provider reports (`memory.calibrate_tokens`).

memproxy counts every request exactly for OpenAI's models (tiktoken, their own encodings). For
other models the count is an estimate: litellm's tokenizer for the model where it has one, else an
OpenAI encoding, and a Claude, a Mistral or a Gemini counts the same text differently, often 10-30%
more. A window filled to the last estimated token can then be over the provider's limit, and the
provider refuses the request: an overflow error that memory could have avoided.

So every answered turn compares what memproxy counted for the request with the `prompt_tokens`
the provider reported for it, and keeps, per model, the factor by which the provider counts more:
the highest ratio seen, and, when later requests show less, a step back towards them each time
(`RELAX` of the way), never below 1 (a provider that counts fewer tokens is not trusted to hold
more than the window). The budget then plans history for the window divided by the factor
(`memory.fit.Budget.planned_tokens`); what must be sent is still refused only by the exact count,
so calibration never causes a 400. A request the provider still refuses for its length (its
`context_length_exceeded`) is planned once more, with the factor raised to what the provider said
it counted where its message says so, else by `STEP`, and sent again: the client sees the answer.

Small requests are not compared (`observed_from`): a provider's fixed additions (Anthropic's
tool-use preamble, a few hundred tokens) would read as a large factor, and only requests near the
window need it. Nor are requests holding media (`memproxy.tokens.holds_media`): an image, a clip or a document
is counted by an estimate of its own (`memproxy.tokens.attachment_tokens`), which says nothing of how
the model's tokenizer counts text, and one image-heavy request (gpt-4o-mini bills a low-detail
image at some 2,800 tokens) would halve the history every other session of the model is planned
with. A refusal of a request holding media raises the factor of that session alone (`SESSIONS`
of them kept per process, the oldest forgotten first), so its next turns are not refused again
while one client's attachment never shrinks every other client's history. The factors are per
process and start at 1; each replica and worker learns its own from its first large requests (and
its first refusal at most, per model).
"""

from __future__ import annotations

import re

RELAX = 0.1  # of the way from the factor to a lower ratio, per request that shows one
STEP = 1.15  # the factor's rise on a refusal whose message gives no count
MAX_FACTOR = 2.0  # beyond this the model's counter is wrong, not merely approximate
MIN_OBSERVED = 1024  # requests counted at fewer tokens are not compared
SESSIONS = 10_000  # sessions whose own factor (a refusal with media) is kept
_NUMBER = re.compile(r"\d[\d,]*")
_IN_MESSAGES = re.compile(r"(\d[\d,]*) in the messages")  # OpenAI: "(8000 in the messages, 1100 in the completion)"
_PLUS = re.compile(r"(\d[\d,]*)\s*\+\s*\d[\d,]*\s*>")  # Anthropic: "188240 + 21333 > 200000" (input + max_tokens)


class Calibration:
    """The factor by which each model's provider counts more tokens than memproxy does; 1 for
    every model when not `enabled` (`memory.calibrate_tokens: false`), and nothing is learnt."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._factors: dict[str, float] = {}
        self._sessions: dict[tuple[str, ...], float] = {}  # (model, tenant, session id): a refusal with media

    def factor(self, model: str, session: tuple[str, str] | None = None) -> float:
        """The model's factor, or that of one session of it (tenant, session id) where higher."""
        factor = self._factors.get(model, 1.0)
        if session is not None and self._sessions:
            return max(factor, self._sessions.get((model, *session), 1.0))
        return factor

    def observe(self, model: str, counted: int, reported: object, window: int) -> float:
        """A request memproxy counted at `counted` tokens, which the provider reported as
        `reported` prompt tokens; the model's factor after it."""
        factor = self.factor(model)
        if not self.enabled or not isinstance(reported, int) or isinstance(reported, bool) \
                or counted < observed_from(window):
            return factor
        ratio = min(max(reported / counted, 1.0), MAX_FACTOR)
        factor = ratio if ratio > factor else factor - (factor - ratio) * RELAX
        self._factors[model] = factor
        return factor

    def refused(self, model: str, counted: int, message: str, window: int,
                session: tuple[str, str] | None = None) -> float:
        """The provider refused a request memproxy counted at `counted` tokens as too long, saying
        `message`; the factor after it: at least `STEP` higher, or the ratio of the prompt's count
        the message gives (`_reported`) to `counted`. The model's, or, given a `session` (tenant,
        session id: a request holding media, which memproxy only estimates), that session's
        alone: it says nothing about how the model counts text, and one client's attachment must
        not shrink every other client's context."""
        factor = self.factor(model, session)
        if not self.enabled:
            return factor
        reported = _reported(message, window)
        ratio = reported / counted if reported is not None and counted > 0 else 0.0
        factor = min(max(factor * STEP, ratio * 1.01), MAX_FACTOR)
        if session is None:
            self._factors[model] = factor
        else:
            key = (model, *session)
            self._sessions.pop(key, None)
            if len(self._sessions) >= SESSIONS:
                del self._sessions[next(iter(self._sessions))]  # the oldest
            self._sessions[key] = factor
        return factor


def _reported(message: str, window: int) -> int | None:
    """The prompt's tokens as a refusal states them: OpenAI's "N in the messages", Anthropic's
    "input + max_tokens > limit", else the largest number above the window ("prompt is too long:
    N tokens > M maximum"); None where it states none."""
    for pattern in (_IN_MESSAGES, _PLUS):
        found = pattern.search(message)
        if found:
            return int(found.group(1).replace(",", ""))
    above = [n for n in (int(n.replace(",", "")) for n in _NUMBER.findall(message)) if n > window]
    return max(above) if above else None


def observed_from(window: int) -> int:
    """The smallest request (in counted tokens) compared with the provider's count."""
    return max(MIN_OBSERVED, window // 8)
