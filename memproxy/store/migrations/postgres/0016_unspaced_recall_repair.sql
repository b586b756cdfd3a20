-- Text in scripts written without spaces (Chinese, Japanese, Korean, Thai, Lao, Burmese, Khmer)
-- indexed again, as `memproxy.searchtext.words_of` now reads it: each run of such characters as its
-- overlapping pairs of characters, where earlier releases indexed the whole run as one word (or, in
-- the Southeast Asian scripts, broke it at each vowel sign), so that a question found only the same
-- sentence again. Every message whose `search_text` holds such a character (the class below is
-- `memproxy.searchtext.UNSPACED`, a test holds them equal; matched in 0.24 s on 100,000 messages)
-- loses it here and gets it anew from the repair's backfill in the same transaction
-- (`memproxy.store.sql.recall.backfill_recall`); the `messages_search` trigger indexes it again.
UPDATE messages SET search_text = NULL WHERE search_text ~ '[฀-໿က-႟ᄀ-ᇿក-៿々぀-ヿ㄰-㆏㐀-䶿一-鿿ꥠ-꥿가-힯豈-﫿ｦ-ﾟ𠀀-𱍏]';
