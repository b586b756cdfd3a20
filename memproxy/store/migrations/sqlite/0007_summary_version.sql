-- The newest summary version saved for a session (0: none yet), kept beside the session, so that
-- serving a turn of a session that has never been summarised needs no summary query.
ALTER TABLE sessions ADD COLUMN summary_version INTEGER NOT NULL DEFAULT 0;
UPDATE sessions SET summary_version = (SELECT coalesce(max(version), 0) FROM summaries
                                       WHERE summaries.session_pk = sessions.pk);
