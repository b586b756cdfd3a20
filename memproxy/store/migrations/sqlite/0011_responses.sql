-- Every response `POST /v1/responses` returned with `store` not false, so that `previous_response_id`,
-- `GET /v1/responses/{id}` and its input items work whatever the provider. A response belongs to its
-- session's turn: deleted with the session, or alone by `DELETE /v1/responses/{id}`. `seq` and
-- `chain_hash` are those of its answer on the session's chain: where a later request that names it
-- continues from. `body` is the response object as returned; `input_items` the items it was asked with.
CREATE TABLE responses (
    tenant TEXT NOT NULL,
    id TEXT NOT NULL,
    session_pk INTEGER NOT NULL REFERENCES sessions (pk) ON DELETE CASCADE,
    seq INTEGER NOT NULL,
    chain_hash TEXT NOT NULL,
    body TEXT NOT NULL,
    input_items TEXT NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (tenant, id)
);
CREATE INDEX responses_session ON responses (session_pk);
