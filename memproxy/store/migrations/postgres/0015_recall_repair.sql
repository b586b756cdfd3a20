-- Recall's columns and lines, repaired where earlier releases left them short (issue 14).
--
-- `0009_recall` as first released had no `recall_text` or `recall_tokens`: a store it migrated then
-- lacks them. Then every message whose recall line is missing or spans more than one line (stored
-- before recall lines were made one line, so that no stored text can pose as another recalled
-- message) gets it anew, and every message stored without its `search_text` (by a release before
-- `0009_recall`, still running beside the one that migrated) gets that too; the `messages_search`
-- trigger indexes it (`memproxy.store.sql.recall.backfill_recall`).
ALTER TABLE messages ADD COLUMN IF NOT EXISTS recall_text TEXT;
ALTER TABLE messages ADD COLUMN IF NOT EXISTS recall_tokens INTEGER;
