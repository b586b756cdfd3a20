-- Words in other scripts indexed again, as `memproxy.searchtext.words_of` now reads them: a run of
-- a script written without spaces (Chinese, Japanese, Korean, Thai, Lao, Burmese, Khmer;
-- `memproxy.searchtext.UNSPACED`) as its overlapping pairs of characters, where earlier releases
-- indexed the whole run as one word, so that a question found only the same sentence again; and
-- every word with its combining marks left out (`memproxy.searchtext.MARKS`: vowel signs, vowel
-- points), where earlier releases broke it at each mark ("दिल्ली" was द, ल, ल). Every message whose
-- body may hold such a character loses its `search_text` here and gets it anew from the repair's
-- backfill in the same transaction (`memproxy.store.sql.recall.backfill_recall`), which puts each
-- active one back in the index: out of it first, under its old text (a contentless FTS5 table
-- deletes a row by the text it was given).
-- "May hold": a body that is not all ASCII (its length in characters and in bytes differ) with a
-- byte that starts one of those characters in UTF-8 (a test holds the list to both classes), but
-- E2: it starts the punctuation most English text holds (’ “ —) and, of marks, only those of symbols
-- and of Old Church Slavonic, whose words stay as they were. Other messages match too, and are
-- indexed again unchanged. Measured on 200,000 messages: 0.3 s; the classes matched by GLOB took
-- seconds.
CREATE TEMP TABLE scripts_repair AS SELECT id FROM messages WHERE length(body) <> length(CAST(body AS BLOB)) AND (
    instr(CAST(body AS BLOB), x'CC') OR instr(CAST(body AS BLOB), x'CD') OR
    instr(CAST(body AS BLOB), x'D2') OR instr(CAST(body AS BLOB), x'D6') OR
    instr(CAST(body AS BLOB), x'D7') OR instr(CAST(body AS BLOB), x'D8') OR
    instr(CAST(body AS BLOB), x'D9') OR instr(CAST(body AS BLOB), x'DB') OR
    instr(CAST(body AS BLOB), x'DC') OR instr(CAST(body AS BLOB), x'DD') OR
    instr(CAST(body AS BLOB), x'DE') OR instr(CAST(body AS BLOB), x'DF') OR
    instr(CAST(body AS BLOB), x'E0') OR instr(CAST(body AS BLOB), x'E1') OR
    instr(CAST(body AS BLOB), x'E3') OR instr(CAST(body AS BLOB), x'E4') OR
    instr(CAST(body AS BLOB), x'E5') OR instr(CAST(body AS BLOB), x'E6') OR
    instr(CAST(body AS BLOB), x'E7') OR instr(CAST(body AS BLOB), x'E8') OR
    instr(CAST(body AS BLOB), x'E9') OR instr(CAST(body AS BLOB), x'EA') OR
    instr(CAST(body AS BLOB), x'EB') OR instr(CAST(body AS BLOB), x'EC') OR
    instr(CAST(body AS BLOB), x'ED') OR instr(CAST(body AS BLOB), x'EF') OR
    instr(CAST(body AS BLOB), x'F0')
);
INSERT INTO messages_fts (messages_fts, rowid, search_text)
SELECT 'delete', session_pk * 4294967296 + seq, search_text FROM messages
WHERE active = 1 AND search_text IS NOT NULL AND id IN (SELECT id FROM scripts_repair);
UPDATE messages SET search_text = NULL WHERE id IN (SELECT id FROM scripts_repair);
DROP TABLE scripts_repair;
