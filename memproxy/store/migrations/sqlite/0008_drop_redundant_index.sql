-- sessions_tenant_activity (tenant, updated_at, pk) serves every query sessions_updated (tenant,
-- updated_at) served; each turn moves a session's updated_at, so each index on it costs a write.
DROP INDEX IF EXISTS sessions_updated;
