-- Recall and search, as in SQLite's 0009_recall: each message's words with its session's
-- `search_key` before each, here as a tsvector whose lexemes are `key_stem` (the english stemmer's
-- stem of each word; its stop words are dropped), built by a trigger from `search_text` and kept
-- only while the message is active, with a GIN index over active messages. Lexemes scoped by
-- session keep the index's posting lists per session, so a lookup costs what the session holds.
-- `memproxy.store.postgres` backfills the text of messages stored before this migration.
ALTER TABLE sessions ADD COLUMN end_user TEXT;
CREATE INDEX sessions_end_user ON sessions (tenant, end_user, updated_at) WHERE end_user IS NOT NULL;
ALTER TABLE messages ADD COLUMN search_text TEXT;
-- What recall shows of a message (`memproxy.searchtext.line_text` of its compact form) and the
-- tokens of that line as the model it was written for counts them (null: counted when recalled).
ALTER TABLE messages ADD COLUMN recall_text TEXT;
ALTER TABLE messages ADD COLUMN recall_tokens INTEGER;
ALTER TABLE messages ADD COLUMN search tsvector;
ALTER TABLE turns ADD COLUMN recalled TEXT;
CREATE FUNCTION memproxy_search_vector(words TEXT) RETURNS tsvector LANGUAGE sql IMMUTABLE AS $$
    SELECT array_to_tsvector(coalesce(array_agg(DISTINCT split_part(t, '_', 1) || '_' || l), '{}'))
    FROM regexp_split_to_table(coalesce(words, ''), ' ') AS t,
         LATERAL unnest(coalesce(ts_lexize('english_stem', substr(t, strpos(t, '_') + 1)), '{}'::text[])) AS l
    WHERE strpos(t, '_') > 0
$$;
CREATE FUNCTION memproxy_messages_search() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.search := CASE WHEN NEW.active = 1 THEN memproxy_search_vector(NEW.search_text) END;
    RETURN NEW;
END
$$;
CREATE TRIGGER messages_search BEFORE INSERT OR UPDATE OF active, search_text ON messages
FOR EACH ROW EXECUTE FUNCTION memproxy_messages_search();
CREATE INDEX messages_search ON messages USING gin (search) WHERE active = 1;
