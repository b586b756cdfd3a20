-- A session row's incarnation: a random number each row gets when it is inserted (a new session, an
-- import, a fork), which the caches in memory compare (`memproxy.store.sql.common.CACHE_HOLDS`). A
-- session deleted and imported again keeps its `created_at`; only this tells the two apart (SQLite
-- may even reuse the deleted rows' ids). 0 for the rows stored before.
ALTER TABLE sessions ADD COLUMN incarnation BIGINT NOT NULL DEFAULT 0;
