-- Compact forms and rolling summaries, as in SQLite's 0002_summaries.
ALTER TABLE messages ADD COLUMN compact_body TEXT;
ALTER TABLE messages ADD COLUMN compact_tokens INTEGER NOT NULL DEFAULT 0;
ALTER TABLE messages ADD COLUMN compact_cum_before BIGINT NOT NULL DEFAULT 0;
UPDATE messages SET compact_tokens = tokens, compact_cum_before = cum_before;
ALTER TABLE sessions ADD COLUMN head_compact_cum BIGINT NOT NULL DEFAULT 0;
UPDATE sessions SET head_compact_cum = head_cum;
CREATE INDEX messages_fit_compact ON messages (session_pk, compact_cum_before)
    WHERE active = 1 AND unit_start = 1;
CREATE INDEX messages_active_user ON messages (session_pk, seq) WHERE active = 1 AND role = 'user';

CREATE TABLE summaries (
    id BIGSERIAL PRIMARY KEY,
    session_pk BIGINT NOT NULL REFERENCES sessions (pk) ON DELETE CASCADE,
    version INTEGER NOT NULL,
    text TEXT NOT NULL,
    covers INTEGER NOT NULL,
    covers_hash TEXT NOT NULL,
    tokens INTEGER NOT NULL,
    replaced_tokens INTEGER NOT NULL,
    model TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    UNIQUE (session_pk, version)
);
