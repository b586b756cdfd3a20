-- What each tenant's calls to the pass-through endpoints spent (embeddings, legacy completions,
-- moderations, images, audio): they belong to no session, so this is their only record. One row per
-- tenant and endpoint, added to by each call; no content, no model input.
CREATE TABLE endpoint_usage (
    tenant TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    calls INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    cost REAL,
    PRIMARY KEY (tenant, endpoint)
);
