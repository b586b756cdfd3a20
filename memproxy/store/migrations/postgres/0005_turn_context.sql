-- What each chat turn's request was made of, as in SQLite's 0005_turn_context.
ALTER TABLE turns ADD COLUMN summary_version INTEGER;
ALTER TABLE turns ADD COLUMN first_sent INTEGER;
ALTER TABLE turns ADD COLUMN included INTEGER;
ALTER TABLE turns ADD COLUMN omitted INTEGER;
ALTER TABLE turns ADD COLUMN unsummarised_omitted INTEGER;
ALTER TABLE turns ADD COLUMN marker INTEGER;
ALTER TABLE turns ADD COLUMN trimmed INTEGER;
ALTER TABLE turns ADD COLUMN deduplicated INTEGER;
