-- What each chat turn's request was made of, so "what did the model see in this turn, and why"
-- can be answered after the fact: the summary version sent (0: none), the first stored position
-- sent, stored messages sent and left out (and of those, the ones no summary stood for), whether a
-- marker was sent, and tool outputs trimmed and repeats deduplicated. Null for summariser calls,
-- forks and turns recorded before this migration.
ALTER TABLE turns ADD COLUMN summary_version INTEGER;
ALTER TABLE turns ADD COLUMN first_sent INTEGER;
ALTER TABLE turns ADD COLUMN included INTEGER;
ALTER TABLE turns ADD COLUMN omitted INTEGER;
ALTER TABLE turns ADD COLUMN unsummarised_omitted INTEGER;
ALTER TABLE turns ADD COLUMN marker INTEGER;
ALTER TABLE turns ADD COLUMN trimmed INTEGER;
ALTER TABLE turns ADD COLUMN deduplicated INTEGER;
