# A file saved as Latin-1.
# expect-status: unusable
# expect-problem: is not UTF-8 text

# café
