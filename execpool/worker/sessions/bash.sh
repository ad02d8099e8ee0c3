# A bash session's runtime (execpool/worker/sessions/__init__.py): its
# stdin is the session's socket, moved to fd 63 (no command sees it); each
# cell arrives as its number, a newline, its source and a NUL, runs in this
# shell (cd, exports, functions and variables stay), and is answered by its
# number, a colon, its exit status and a NUL; it says the number and "!"
# once SIGINT would reach the cell. SIGINT (a timeout, a cancel) ends the
# cell's foreground command and then the cell, with status 130; the shell
# lives on.
exec 63<&0 0</dev/null
trap '' INT
__execpool_cell() { trap 'return 130' INT; printf '%s!\0' "$__execpool_number" >&63; eval "$1" 63<&-; }
while IFS= read -r -d '' -u 63 __execpool_source; do
    __execpool_number=${__execpool_source%%$'\n'*}
    __execpool_cell "${__execpool_source#*$'\n'}"
    __execpool_status=$?
    trap '' INT
    printf '%s:%s\0' "$__execpool_number" "$__execpool_status" >&63
done
