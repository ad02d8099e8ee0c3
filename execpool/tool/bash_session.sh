# A bash session's runtime (execpool/worker/sessions/__init__.py): its
# stdin is the session's socket, moved to fd 63 (no command sees it), and
# its stderr kept on fd 62 for the cells; each cell arrives as its number,
# a newline, its source and a NUL, runs in this shell (cd, exports,
# functions and variables stay), and is answered by its number, a colon,
# what it cost (the `time` keyword's report: the CPU seconds of the shell
# and of what it waited for, user and system), a newline, its exit status
# and a NUL; it says the number and "!" once SIGINT would reach the cell.
# SIGINT (a timeout, a cancel) ends the cell's foreground command and then
# the cell, with status 130; the shell lives on.
exec 63<&0 0</dev/null 62>&2
trap '' INT
TIMEFORMAT='%3U %3S'
__execpool_cell() {
    trap 'return 130' INT
    printf '%s!\0%s:' "$__execpool_number" "$__execpool_number" >&63
    eval "$1" 62>&- 63<&-
}
while IFS= read -r -d '' -u 63 __execpool_source; do
    __execpool_number=${__execpool_source%%$'\n'*}
    { time __execpool_cell "${__execpool_source#*$'\n'}" 2>&62; } 2>&63
    __execpool_status=$?
    trap '' INT
    printf '\n%s\0' "$__execpool_status" >&63
done
