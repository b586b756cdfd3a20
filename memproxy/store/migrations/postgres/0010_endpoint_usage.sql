-- What each tenant's calls to the pass-through endpoints spent, as in SQLite's 0010_endpoint_usage.
CREATE TABLE endpoint_usage (
    tenant TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    calls BIGINT NOT NULL,
    prompt_tokens BIGINT NOT NULL,
    completion_tokens BIGINT NOT NULL,
    cost DOUBLE PRECISION,
    PRIMARY KEY (tenant, endpoint)
);
