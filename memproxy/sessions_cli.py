"""`memproxy sessions ...`: the admin verbs on the store directly, whether the server runs or not.

SQLite in WAL mode lets the CLI read and write while a server holds the file (writes wait on the
busy timeout). Tables for people, `--json` for scripts. Only `context` loads litellm (it must count
tokens and know the model's window).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from typing import Any

from . import admin, exports
from .config import Config
from .errors import ProxyError
from .jsonparse import parse_json
from .memory.retention import expired_before, has_expired
from .session_ids import is_session_id
from .store import SessionState, Store, open_store
from .store.errors import StoreConflict, StoreUnavailable

_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd]?)")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def add_parser(commands: Any) -> None:
    sessions = commands.add_parser("sessions", help="list, inspect, export, delete sessions")
    sessions.add_argument("-c", "--config", help="YAML config file (for storage.url and models)")
    _add_common(sessions, after_verb=False)
    # The same options after the verb (`sessions list --tenant a`): there they are only set when
    # given, so they never undo what was given before the verb.
    common = argparse.ArgumentParser(add_help=False)
    _add_common(common, after_verb=True)
    verbs = sessions.add_subparsers(dest="verb", required=True)

    def verb(name: str, text: str) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = verbs.add_parser(name, help=text, parents=[common])
        return parser

    listing = verb("list", "sessions, newest activity first (every tenant without --tenant)")
    listing.add_argument("--limit", type=int, default=50)
    listing.add_argument("--after", help="the cursor a previous page printed")
    verb("show", "a session's messages, branches, summary, metadata and turns").add_argument("id")
    context = verb("context", "what the next request would send, part by part")
    context.add_argument("id")
    context.add_argument("--model", help="the model the request names (default: the one the session last chatted with)")
    context.add_argument("--message", help="the new user message of that request")
    export = verb("export", "a session as JSON lines")
    export.add_argument("id")
    export.add_argument("-o", "--output", help="file to write (default: standard output)")
    imported = verb("import", "a session from an export")
    imported.add_argument("file", help="an export, or - for standard input")
    imported.add_argument("--id", help="the new session id (default: the exported one)")
    rm = verb("rm", "delete a session and everything about it, for good")
    rm.add_argument("id", nargs="?")
    rm.add_argument("--all", action="store_true", help="every session of the tenant, whatever its clock says")
    verb("clear", "start a session afresh, keeping its record").add_argument("id")
    fork = verb("fork", "copy a session's first messages into a new session")
    fork.add_argument("id")
    fork.add_argument("new_id")
    fork.add_argument("--at", type=int, help="messages to keep (default: all)")
    prune = verb("prune", "delete the tenant's sessions idle for longer than a duration")
    prune.add_argument("--older-than", required=True, help="e.g. 30d, 12h, 15m, 0s")
    prune.add_argument("--all-tenants", action="store_true", help="every tenant's, not only --tenant's")
    metadata = verb("metadata", "a session's metadata; --set replaces it, --merge merges top-level keys")
    metadata.add_argument("id")
    change = metadata.add_mutually_exclusive_group()
    change.add_argument("--set", metavar="JSON", help="replace it with this object (creates the session)")
    change.add_argument("--merge", metavar="JSON", help="merge this object's keys (null removes a key)")
    search = verb("search", "stored messages matching words, best first (one session with --session)")
    search.add_argument("query", help="the words to look for")
    search.add_argument("--session", help="search this session only")
    search.add_argument("--limit", type=int, default=20)
    search.add_argument("--all-tenants", action="store_true", help="every tenant's sessions, not only --tenant's")
    usage = verb("usage", "what the tenant's sessions spent, deleted ones included")
    usage.add_argument("--all-tenants", action="store_true", help="every tenant's together")


def _add_common(parser: argparse.ArgumentParser, after_verb: bool) -> None:
    parser.add_argument("--tenant", default=argparse.SUPPRESS if after_verb else None,
                        help="the tenant (default: 'default'; list: every tenant)")
    parser.add_argument("--json", action="store_true", default=argparse.SUPPRESS if after_verb else False,
                        help="machine-readable output")


def run(args: argparse.Namespace, config: Config) -> int:
    try:
        return asyncio.run(_run(args, config))
    except (ProxyError, StoreConflict) as exc:
        print(f"memproxy: {exc.message}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        raise  # the reader stopped reading (`| head`): `cli.main` stops quietly
    except (StoreUnavailable, OSError, ValueError) as exc:  # the store cannot be reached, a file read
        print(f"memproxy: {failure(exc)}", file=sys.stderr)
        return 1


def failure(exc: BaseException) -> str:
    """One line for a store that cannot be opened or written, or a file that cannot be read: what
    failed, never a traceback (nor the driver's text, which may quote a URL with its password)."""
    if isinstance(exc, StoreUnavailable):
        cause = exc.__cause__
        return f"the store is unavailable ({type(cause).__name__ if cause else 'no cause given'})"
    if isinstance(exc, OSError):
        where = f": {exc.filename}" if exc.filename else ""
        return f"{exc.strerror or type(exc).__name__}{where}"
    return f"{type(exc).__name__}: {exc}"


async def _run(args: argparse.Namespace, config: Config) -> int:
    store = await open_store(config.storage)
    try:
        verb: Callable[[argparse.Namespace, Config, Store], Awaitable[int]] = _VERBS[args.verb]
        return await verb(args, config, store)
    finally:
        await store.close()


def _tenant(args: argparse.Namespace) -> str:
    return str(args.tenant or "default")


async def _session(args: argparse.Namespace, store: Store, session_id: str) -> SessionState:
    session = await store.get_session(_tenant(args), session_id) if is_session_id(session_id) else None
    if session is None:
        raise ProxyError(f"no session '{session_id}' in tenant '{_tenant(args)}'")
    return session


# What a terminal acts on rather than shows: C0 and C1 controls but the tab (escape sequences set
# its title, clear the screen, move the cursor to overwrite a line, or write the clipboard) and the
# bidirectional overrides (text shown in another order than it reads).
_UNSHOWN = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _shown(text: str) -> str:
    """`text` with the characters a terminal would act on escaped (`\\u001b`)."""
    return _UNSHOWN.sub(lambda found: f"\\u{ord(found.group()):04x}", text)


def _out(line: str) -> None:
    """A line for a person at a terminal: what clients wrote (messages, titles, metadata keys) is in
    it, so the characters a terminal would act on are shown escaped, never sent to it."""
    print(_shown(line))


def _print_json(value: Any) -> None:
    print(json.dumps(value, ensure_ascii=False, indent=2))


def _when(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, timezone.utc).strftime("%Y-%m-%d %H:%M")


def _table(rows: list[list[str]], header: list[str]) -> None:
    rows = [[_shown(str(cell)) for cell in row] for row in rows]  # escaped before the columns are measured
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip())


async def _list(args: argparse.Namespace, config: Config, store: Store) -> int:
    page = await admin.list_sessions(store, args.tenant, args.limit, args.after)
    if args.json:
        _print_json(page)
        return 0
    _table([[s["tenant"], s["id"], _when(s["updated_at"]), str(s["message_count"]), str(s["tokens_stored"]),
             str(s["usage"]["prompt_tokens"] + s["usage"]["completion_tokens"]), str(s["summary_version"]),
             (s["title"] or "")[:40]] for s in page["data"]],
           ["TENANT", "SESSION", "UPDATED (UTC)", "MESSAGES", "TOKENS", "SPENT", "SUMMARY", "TITLE"])
    if page["next"]:
        _out(f"more: --after {page['next']}")
    return 0


async def _show(args: argparse.Namespace, config: Config, store: Store) -> int:
    detail = await admin.show(store, await _session(args, store, args.id))
    if args.json:
        _print_json(detail)
        return 0
    _out(f"session {detail['id']} (tenant {detail['tenant']}): {detail['message_count']} messages, "
          f"{detail['tokens_stored']} tokens, summary v{detail['summary_version']}")
    for message in detail["system"] or []:
        _out(f"  [system] {_text(message)}")
    if detail["summary"]:
        _out(f"  [summary v{detail['summary']['version']} of {detail['summary']['covers_messages']} "
              f"messages] {detail['summary']['text']}")
    for item in detail["messages"]:
        _out(f"  {item['position']:>4} {item['message'].get('role'):<9} {_text(item['message'])}")
    for branch in detail["superseded"]:
        _out(f"  superseded branch from position {branch['forked_at']}: {len(branch['messages'])} messages")
    if detail["metadata"]:
        _out(f"  metadata keys: {', '.join(sorted(detail['metadata']))}")
    for turn in detail["turns"]:
        _out(f"  turn {turn['turn']:>3} {turn['kind']:<10} {turn['model']}: {_sent_text(turn)}")
    return 0


def _sent_text(turn: dict[str, Any]) -> str:
    """What a turn's request was made of, in a line."""
    sent = turn["sent"]
    if sent is None:
        return f"{turn['context_tokens']} tokens"
    parts = [f"summary v{sent['summary_version']}"] if sent["summary_version"] else []
    parts += ["marker"] if sent["marker"] else []
    parts.append(f"{sent['stored_included']} stored from position {sent['from_position']}")
    return (f"{turn['context_tokens']} tokens: {' + '.join(parts)}; left out {sent['stored_omitted']} "
            f"({sent['unsummarised_omitted']} unsummarised); {sent['tool_outputs_trimmed']} trimmed, "
            f"{sent['deduplicated']} deduplicated" + (f"; {len(sent['recalled'])} recalled" if sent["recalled"] else ""))


def _text(message: dict[str, Any]) -> str:
    content = message.get("content")
    text = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
    calls = message.get("tool_calls")
    if calls:
        text = f"{text or ''} [calls {', '.join(c['function']['name'] for c in calls)}]".strip()
    return text.replace("\n", " ")[:120]


async def _context(args: argparse.Namespace, config: Config, store: Store) -> int:
    session = await _session(args, store, args.id)
    model = await admin.session_model(store, config, session, args.model)
    # The planner, the provider and the summariser it plans with: imported here, for this command
    # alone, so that the others start without them (about half of a command's start-up time).
    from .concurrency import BackgroundTasks
    from .memory.summaries import Summarizer
    from .preview import context
    from .provider import Provider

    provider = Provider(config)
    summarizer = Summarizer(config, store, provider, BackgroundTasks())
    new = [{"role": "user", "content": args.message}] if args.message else []
    preview = await context(store, summarizer, provider, config, model, _tenant(args), session, new, {})
    await provider.close()
    if args.json:
        _print_json(preview)
        return 0
    budget = preview["budget"]
    _out(f"model {preview['model']}: {preview['tokens']} of {budget['input_tokens']} input tokens "
          f"(window {budget['window']} - output {budget['output_reserve']} - margin {budget['safety_margin']})")
    for part in preview["parts"]:
        details = ", ".join(f"{k}={v}" for k, v in part.items() if k not in ("part", "excerpts", "query"))
        _out(f"  {part['part']:<18} {details}")
        for excerpt in part.get("excerpts", []):  # recalled messages: where from, and why
            why = f"score {excerpt['score']}, matched {','.join(excerpt['matched'])}" if excerpt["hit"] else "context"
            _out(f"    {excerpt['session_id']} #{excerpt['position']} {excerpt['role']} ({why})")
    return 0


async def _export(args: argparse.Namespace, config: Config, store: Store) -> int:
    text = exports.to_jsonl(await store.export_session(await _session(args, store, args.id)))
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            handle.write(text)
    else:
        sys.stdout.write(text)
    return 0


async def _import(args: argparse.Namespace, config: Config, store: Store) -> int:
    if args.file == "-":
        text = sys.stdin.read()
    else:
        with open(args.file, encoding="utf-8") as handle:
            text = handle.read()
    records = exports.from_jsonl(text)
    session_id = args.id if args.id is not None else exports.exported_id(records)  # `--id ""`: refused
    if not is_session_id(session_id):
        raise ProxyError(f"not a session id: {session_id!r}")
    await store.import_session(_tenant(args), session_id, records)
    _done(args, {"id": session_id, "imported": True}, f"imported {session_id}")
    return 0


async def _rm(args: argparse.Namespace, config: Config, store: Store) -> int:
    if args.all == bool(args.id):
        raise ProxyError("rm takes a session id, or --all for every session of the tenant")
    if args.all:
        deleted = await store.delete_tenant(_tenant(args))
        _done(args, {"tenant": _tenant(args), "deleted": deleted}, f"deleted {deleted} sessions")
        return 0
    await store.delete_session(await _session(args, store, args.id))
    _done(args, {"id": args.id, "deleted": True}, f"deleted {args.id}")
    return 0


async def _clear(args: argparse.Namespace, config: Config, store: Store) -> int:
    session = await _session(args, store, args.id)
    if not await store.clear_session(session, expired_before(config.retention.idle_ttl_seconds)):
        raise ProxyError(f"no session '{args.id}' in tenant '{_tenant(args)}'")
    _done(args, {"id": args.id, "cleared": True}, f"cleared {args.id}")
    return 0


async def _fork(args: argparse.Namespace, config: Config, store: Store) -> int:
    session = await _session(args, store, args.id)
    at = await admin.fork(store, session, _tenant(args), args.new_id, args.at)
    _done(args, {"id": args.new_id, "forked_from": args.id, "messages": at},
          f"forked {args.id} at {at} into {args.new_id}")
    return 0


async def _prune(args: argparse.Namespace, config: Config, store: Store) -> int:
    match = _DURATION.fullmatch(args.older_than.strip())
    if match is None:
        raise ProxyError("--older-than takes a duration such as 30d, 12h, 15m or 0s")
    seconds = float(match.group(1)) * _UNITS[match.group(2)]
    removed = await store.prune(time.time() - seconds, _tenants(args))
    _done(args, {"deleted": removed}, f"deleted {removed} sessions")
    return 0


async def _metadata(args: argparse.Namespace, config: Config, store: Store) -> int:
    """Shown as JSON either way: the values are the agent's own, printed only when asked for."""
    cutoff = expired_before(config.retention.idle_ttl_seconds)
    tenant = _tenant(args)
    if not is_session_id(args.id):
        raise ProxyError(f"not a session id: {args.id!r}")
    if args.set is not None:
        metadata: Any = _json_object(args.set, "--set")
        await store.set_metadata(tenant, args.id, metadata, cutoff)
    elif args.merge is not None:
        metadata = await store.merge_metadata(tenant, args.id, _json_object(args.merge, "--merge"), cutoff)
        if metadata is None:
            raise ProxyError(f"no session '{args.id}' in tenant '{tenant}'")
    else:
        session = await _session(args, store, args.id)
        expired = has_expired(session, config.retention.idle_ttl_seconds)
        metadata = {} if expired else await store.get_metadata(session)
    _print_json(metadata)
    return 0


def _json_object(text: str, option: str) -> dict[str, Any]:
    """An option's JSON object, read as a request body is (`jsonparse.parse_json`): what the HTTP API
    refuses (NaN, a lone surrogate, nesting past its limit) is refused here too, before anything
    is written, or it would break the session's metadata reads and exports."""
    try:
        value = parse_json(text, option)
    except ProxyError as exc:
        raise ProxyError(f"{option} takes a JSON object: {exc.message}") from exc
    if not isinstance(value, dict):
        raise ProxyError(f"{option} takes a JSON object")
    return value


async def _search(args: argparse.Namespace, config: Config, store: Store) -> int:
    session = await _session(args, store, args.session) if args.session else None
    found = await admin.search(store, _tenant(args) if session else _tenants(args),
                               {"query": args.query, "limit": args.limit}, session,
                               expired_before(config.retention.idle_ttl_seconds))
    if args.json:
        _print_json(found)
        return 0
    _table([[hit["tenant"], hit["session_id"], str(hit["position"]), str(hit["role"]), _when(hit["created_at"]),
             f"{hit['score']:.2f}", ",".join(hit["matched"]), _text(hit["message"])[:60]] for hit in found["data"]],
           ["TENANT", "SESSION", "POS", "ROLE", "WHEN (UTC)", "SCORE", "MATCHED", "TEXT"])
    return 0


async def _usage(args: argparse.Namespace, config: Config, store: Store) -> int:
    usage = await admin.usage(store, _tenants(args))
    if args.json:
        _print_json(usage)
        return 0
    deleted = usage["deleted_sessions"]
    rows = [[name, str(usage[key]), str(deleted[key])] for name, key in _USAGE_ROWS]
    _table(rows, [f"TENANT {usage['tenant'] or '(all)'}", "TOTAL", "OF WHICH DELETED SESSIONS"])
    if usage["endpoints"]:  # the calls to embeddings, images, ... that the totals include
        print()
        _table([[name, str(spent["calls"]), str(spent["prompt_tokens"]), str(spent["completion_tokens"]),
                 str(spent["cost"])] for name, spent in usage["endpoints"].items()],
               ["ENDPOINT", "CALLS", "PROMPT TOKENS", "COMPLETION TOKENS", "COST"])
    return 0


_USAGE_ROWS = [("sessions", "sessions"), ("turns", "turns"), ("summariser calls", "summary_calls"),
               ("prompt tokens", "prompt_tokens"), ("completion tokens", "completion_tokens"),
               ("cost", "cost"), ("tokens sent", "context_tokens"),
               ("tokens resending everything", "full_history_tokens"), ("tokens saved", "tokens_saved")]


def _tenants(args: argparse.Namespace) -> str | None:
    """The tenant a verb acts on; None (every tenant) only with --all-tenants, never by default."""
    if not args.all_tenants:
        return _tenant(args)
    if args.tenant:
        raise ProxyError("--all-tenants and --tenant name different things: give one")
    return None


def _done(args: argparse.Namespace, result: dict[str, Any], text: str) -> None:
    if args.json:
        _print_json(result)
    else:
        _out(text)


_VERBS: dict[str, Callable[[argparse.Namespace, Config, Store], Awaitable[int]]] = {
    "list": _list, "show": _show, "context": _context, "export": _export, "import": _import,
    "rm": _rm, "clear": _clear, "fork": _fork, "prune": _prune, "metadata": _metadata, "usage": _usage,
    "search": _search,
}
