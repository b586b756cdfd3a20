-- The compact form an older message is sent in (a tool output trimmed to head + tail), with its
-- token count and running total, so fitting history stays one indexed lookup.
ALTER TABLE messages ADD COLUMN compact_body TEXT;
ALTER TABLE messages ADD COLUMN compact_tokens INTEGER NOT NULL DEFAULT 0;
ALTER TABLE messages ADD COLUMN compact_cum_before INTEGER NOT NULL DEFAULT 0;
UPDATE messages SET compact_tokens = tokens, compact_cum_before = cum_before;
ALTER TABLE sessions ADD COLUMN head_compact_cum INTEGER NOT NULL DEFAULT 0;
UPDATE sessions SET head_compact_cum = head_cum;
CREATE INDEX messages_fit_compact ON messages (session_pk, compact_cum_before)
    WHERE active = 1 AND unit_start = 1;
CREATE INDEX messages_active_user ON messages (session_pk, seq) WHERE active = 1 AND role = 'user';

-- Rolling summaries: every version is kept; the one in use is the newest whose covered messages are
-- still the session's active history (an edit before `covers` makes it stale, never wrong).
CREATE TABLE summaries (
    id INTEGER PRIMARY KEY,
    session_pk INTEGER NOT NULL REFERENCES sessions (pk) ON DELETE CASCADE,
    version INTEGER NOT NULL,
    text TEXT NOT NULL,
    covers INTEGER NOT NULL,
    covers_hash TEXT NOT NULL,
    tokens INTEGER NOT NULL,
    replaced_tokens INTEGER NOT NULL,
    model TEXT NOT NULL,
    created_at REAL NOT NULL,
    UNIQUE (session_pk, version)
);
