-- Text in scripts written without spaces (Chinese, Japanese, Korean) indexed again, as
-- `memproxy.searchtext.words_of` now reads it: each run of such characters as its overlapping pairs
-- of characters, where earlier releases indexed the whole run as one word (a question found only
-- the same sentence again). Every message whose `search_text` holds such a character (the class
-- below is `memproxy.searchtext.CJK`, a test holds them equal; matched in 0.24 s on 100,000
-- messages) loses it here and gets it anew from the repair's backfill in the same transaction
-- (`memproxy.store.sql.recall.backfill_recall`); the `messages_search` trigger indexes it again.
UPDATE messages SET search_text = NULL WHERE search_text ~ '[ᄀ-ᇿ々぀-ヿ㄰-㆏㐀-䶿一-鿿ꥠ-꥿가-힯豈-﫿ｦ-ﾟ𠀀-𱍏]';
