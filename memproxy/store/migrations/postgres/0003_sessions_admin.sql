-- Titles, metadata, cost and full-history tokens, as in SQLite's 0003_sessions_admin.
ALTER TABLE sessions ADD COLUMN title TEXT;
ALTER TABLE sessions ADD COLUMN metadata TEXT;
ALTER TABLE turns ADD COLUMN cost DOUBLE PRECISION;
ALTER TABLE turns ADD COLUMN full_tokens BIGINT;
CREATE INDEX sessions_activity ON sessions (updated_at, pk);
CREATE INDEX sessions_tenant_activity ON sessions (tenant, updated_at, pk);
CREATE INDEX messages_parent ON messages (parent_id);
