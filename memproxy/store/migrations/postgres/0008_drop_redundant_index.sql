-- As in SQLite's 0008_drop_redundant_index: sessions_tenant_activity serves what sessions_updated did.
DROP INDEX IF EXISTS sessions_updated;
