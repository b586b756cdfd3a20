-- The usage of each tenant's deleted sessions, as in SQLite's 0006_tenant_usage.
CREATE TABLE tenant_usage (
    tenant TEXT PRIMARY KEY,
    sessions BIGINT NOT NULL,
    turns BIGINT NOT NULL,
    summary_calls BIGINT NOT NULL,
    prompt_tokens BIGINT NOT NULL,
    completion_tokens BIGINT NOT NULL,
    cost DOUBLE PRECISION,
    context_tokens BIGINT NOT NULL,
    full_tokens BIGINT NOT NULL
);
