-- What operators see and manage: a title and free metadata per session, and what each turn cost
-- against what resending the whole history would have cost.
ALTER TABLE sessions ADD COLUMN title TEXT;
ALTER TABLE sessions ADD COLUMN metadata TEXT;
ALTER TABLE turns ADD COLUMN cost REAL;
ALTER TABLE turns ADD COLUMN full_tokens INTEGER;
CREATE INDEX sessions_activity ON sessions (updated_at, pk);
CREATE INDEX sessions_tenant_activity ON sessions (tenant, updated_at, pk);
CREATE INDEX messages_parent ON messages (parent_id);
