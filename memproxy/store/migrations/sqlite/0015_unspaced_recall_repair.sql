-- Text in scripts written without spaces (Chinese, Japanese, Korean, Thai, Lao, Burmese, Khmer)
-- indexed again, as `memproxy.searchtext.words_of` now reads it: each run of such characters as its
-- overlapping pairs of characters, where earlier releases indexed the whole run as one word (or, in
-- the Southeast Asian scripts, broke it at each vowel sign), so that a question found only the same
-- sentence again. Every message whose `search_text` may hold such a character loses it here and
-- gets it anew from the repair's backfill in the same transaction
-- (`memproxy.store.sql.recall.backfill_recall`), which puts each active one back in the index:
-- out of it first, under its old text (a contentless FTS5 table deletes a row by the text it was
-- given). "May hold": text that is not all ASCII (its length in characters and in bytes differ)
-- with a byte that starts those scripts' characters in UTF-8 (`memproxy.searchtext.UNSPACED`:
-- Thai and Lao E0, Burmese, Khmer and Hangul Jamo E1, kana and Han E3-E9, Hangul EA-ED,
-- compatibility forms EF, Han extensions F0; a test holds them equal). Other messages match too
-- (Indic scripts start with E0), and are indexed again as they were. Measured on 200,000 messages:
-- 0.2 s; the class of characters itself, matched by GLOB, took 8.9 s.
INSERT INTO messages_fts (messages_fts, rowid, search_text)
SELECT 'delete', session_pk * 4294967296 + seq, search_text FROM messages
WHERE active = 1 AND length(search_text) <> length(CAST(search_text AS BLOB)) AND (
    instr(CAST(search_text AS BLOB), x'E0') OR instr(CAST(search_text AS BLOB), x'E1') OR
    instr(CAST(search_text AS BLOB), x'E3') OR instr(CAST(search_text AS BLOB), x'E4') OR
    instr(CAST(search_text AS BLOB), x'E5') OR instr(CAST(search_text AS BLOB), x'E6') OR
    instr(CAST(search_text AS BLOB), x'E7') OR instr(CAST(search_text AS BLOB), x'E8') OR
    instr(CAST(search_text AS BLOB), x'E9') OR instr(CAST(search_text AS BLOB), x'EA') OR
    instr(CAST(search_text AS BLOB), x'EB') OR instr(CAST(search_text AS BLOB), x'EC') OR
    instr(CAST(search_text AS BLOB), x'ED') OR instr(CAST(search_text AS BLOB), x'EF') OR
    instr(CAST(search_text AS BLOB), x'F0')
);
UPDATE messages SET search_text = NULL WHERE length(search_text) <> length(CAST(search_text AS BLOB)) AND (
    instr(CAST(search_text AS BLOB), x'E0') OR instr(CAST(search_text AS BLOB), x'E1') OR
    instr(CAST(search_text AS BLOB), x'E3') OR instr(CAST(search_text AS BLOB), x'E4') OR
    instr(CAST(search_text AS BLOB), x'E5') OR instr(CAST(search_text AS BLOB), x'E6') OR
    instr(CAST(search_text AS BLOB), x'E7') OR instr(CAST(search_text AS BLOB), x'E8') OR
    instr(CAST(search_text AS BLOB), x'E9') OR instr(CAST(search_text AS BLOB), x'EA') OR
    instr(CAST(search_text AS BLOB), x'EB') OR instr(CAST(search_text AS BLOB), x'EC') OR
    instr(CAST(search_text AS BLOB), x'ED') OR instr(CAST(search_text AS BLOB), x'EF') OR
    instr(CAST(search_text AS BLOB), x'F0')
);
