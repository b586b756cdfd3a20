-- Recall and search (issue 14): a full-text index of every active message, scoped by session.
--
-- Each message's words (`memproxy.searchtext.message_words`) are stored in `search_text` with its
-- session's key before each (`key_word`, `memproxy.searchtext.session_key`), so the index's document
-- lists are per session: a lookup, and BM25's document frequencies, cost what the session holds, not
-- the whole store. The FTS5 table is contentless; its rowid is `session_pk * 2^32 + seq` (unique
-- among active messages), so "this session, before position N" is a rowid range. Triggers keep it
-- exact: a message is in it exactly while it is active (inserted active, superseded, deleted, or
-- deleted with its session).
-- `memproxy.store.sqlite` backfills the text of messages stored before this migration.
ALTER TABLE sessions ADD COLUMN end_user TEXT;
CREATE INDEX sessions_end_user ON sessions (tenant, end_user, updated_at) WHERE end_user IS NOT NULL;
ALTER TABLE messages ADD COLUMN search_text TEXT;
-- What recall shows of a message (`memproxy.searchtext.line_text` of its compact form) and the
-- tokens of that line as the model it was written for counts them (null: counted when recalled).
ALTER TABLE messages ADD COLUMN recall_text TEXT;
ALTER TABLE messages ADD COLUMN recall_tokens INTEGER;
ALTER TABLE turns ADD COLUMN recalled TEXT;
CREATE VIRTUAL TABLE messages_fts USING fts5(
    search_text, content = '', tokenize = "porter unicode61 remove_diacritics 2 tokenchars '_'"
);
CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages
WHEN new.active = 1 AND new.search_text IS NOT NULL BEGIN
    INSERT INTO messages_fts (rowid, search_text) VALUES (new.session_pk * 4294967296 + new.seq, new.search_text);
END;
CREATE TRIGGER messages_fts_supersede AFTER UPDATE OF active ON messages
WHEN old.active = 1 AND new.active = 0 AND old.search_text IS NOT NULL BEGIN
    INSERT INTO messages_fts (messages_fts, rowid, search_text)
    VALUES ('delete', old.session_pk * 4294967296 + old.seq, old.search_text);
END;
CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages
WHEN old.active = 1 AND old.search_text IS NOT NULL BEGIN
    INSERT INTO messages_fts (messages_fts, rowid, search_text)
    VALUES ('delete', old.session_pk * 4294967296 + old.seq, old.search_text);
END;
