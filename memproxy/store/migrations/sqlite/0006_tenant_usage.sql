-- What a tenant's deleted sessions had spent (deleted by the API, the CLI, prune, the retention
-- sweep or expiry), added up in the transaction that deletes them: usage accounting outlives the
-- conversations. One row per tenant; no session id, no content.
CREATE TABLE tenant_usage (
    tenant TEXT PRIMARY KEY,
    sessions INTEGER NOT NULL,
    turns INTEGER NOT NULL,
    summary_calls INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    cost REAL,
    context_tokens INTEGER NOT NULL,
    full_tokens INTEGER NOT NULL
);
