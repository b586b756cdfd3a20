-- The newest summary version saved for a session, as in SQLite's 0007_summary_version.
ALTER TABLE sessions ADD COLUMN summary_version INTEGER NOT NULL DEFAULT 0;
UPDATE sessions SET summary_version = (SELECT coalesce(max(version), 0) FROM summaries
                                       WHERE summaries.session_pk = sessions.pk);
