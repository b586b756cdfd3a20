-- The responses memproxy returned and keeps, as in SQLite's 0011_responses.
CREATE TABLE responses (
    tenant TEXT NOT NULL,
    id TEXT NOT NULL,
    session_pk BIGINT NOT NULL REFERENCES sessions (pk) ON DELETE CASCADE,
    seq BIGINT NOT NULL,
    chain_hash TEXT NOT NULL,
    body TEXT NOT NULL,
    input_items TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (tenant, id)
);
CREATE INDEX responses_session ON responses (session_pk);
