-- The same schema as SQLite's 0001_initial, in PostgreSQL's types.
CREATE TABLE sessions (
    pk BIGSERIAL PRIMARY KEY,
    tenant TEXT NOT NULL,
    session_id TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL,
    length INTEGER NOT NULL DEFAULT 0,
    head_hash TEXT NOT NULL DEFAULT '',
    head_cum BIGINT NOT NULL DEFAULT 0,
    system_prompt TEXT,
    history_mode TEXT,
    UNIQUE (tenant, session_id)
);
CREATE INDEX sessions_updated ON sessions (tenant, updated_at);

CREATE TABLE turns (
    id BIGSERIAL PRIMARY KEY,
    session_pk BIGINT NOT NULL REFERENCES sessions (pk) ON DELETE CASCADE,
    created_at DOUBLE PRECISION NOT NULL,
    model TEXT NOT NULL,
    kind TEXT NOT NULL,
    context_tokens INTEGER NOT NULL,
    prompt_tokens INTEGER,
    completion_tokens INTEGER,
    latency_ms DOUBLE PRECISION NOT NULL
);
CREATE INDEX turns_session ON turns (session_pk, id);

CREATE TABLE messages (
    id BIGSERIAL PRIMARY KEY,
    session_pk BIGINT NOT NULL REFERENCES sessions (pk) ON DELETE CASCADE,
    turn_id BIGINT NOT NULL REFERENCES turns (id) ON DELETE CASCADE,
    parent_id BIGINT REFERENCES messages (id),
    seq INTEGER NOT NULL,
    active INTEGER NOT NULL DEFAULT 1,
    role TEXT NOT NULL,
    body TEXT NOT NULL,
    tokens INTEGER NOT NULL,
    cum_before BIGINT NOT NULL,
    unit_start INTEGER NOT NULL,
    chain_hash TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL
);
CREATE UNIQUE INDEX messages_active_seq ON messages (session_pk, seq) WHERE active = 1;
CREATE UNIQUE INDEX messages_active_hash ON messages (session_pk, chain_hash) WHERE active = 1;
CREATE INDEX messages_fit ON messages (session_pk, cum_before) WHERE active = 1 AND unit_start = 1;
CREATE INDEX messages_session ON messages (session_pk, id);
