"""The command line's jobs (demo, bench) and the pieces they need (corpus, word2vec).

Built on speedswap's public API only; nothing below imports from here.
"""
