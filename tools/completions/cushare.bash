# bash completion for cushare (installed as share/bash-completion/completions/cushare).
# Verbs and options are read from the installed cushare's own --help, so they always match it;
# tenant names come from the broker (`cushare tenants`), quietly nothing when none answers.

_cushare_words() {  # the verbs, or a verb's options: from cushare's help text
  if [[ -z ${1:-} ]]; then
    cushare --help 2>/dev/null | awk '/^verbs:/ {v=1; next} /^[a-z]/ {v=0} v && /^  [a-z]/ {print $1}'
  else
    cushare "$1" --help 2>/dev/null | grep -o -- '--[a-z][a-z-]*' | sort -u
    echo --json --help
  fi
}

_cushare_tenants() {  # [socket [broker-user]]: the same broker the command line names
  local global=()
  [[ -n ${1:-} ]] && global+=(--socket "$1")
  [[ -n ${2:-} ]] && global+=(--broker-user "$2")
  cushare "${global[@]}" --json tenants 2>/dev/null | grep -o '"name": *"[^"]*"' | sed 's/.*"\([^"]*\)"$/\1/' | sort -u
}

_cushare() {
  local cur=${COMP_WORDS[COMP_CWORD]} prev=${COMP_WORDS[COMP_CWORD-1]}
  local i verb="" socket="" user=""
  for ((i = 1; i < COMP_CWORD; i++)); do
    case ${COMP_WORDS[i]} in
      --socket) socket=${COMP_WORDS[i+1]}; ((i++)) ;;
      --broker-user) user=${COMP_WORDS[i+1]}; ((i++)) ;;
      --) if [[ $verb == run ]]; then  # the command: its name, then its own arguments (files)
            ((COMP_CWORD == i + 1)) && COMPREPLY=($(compgen -c -- "$cur")) || { compopt -o filenames 2>/dev/null; COMPREPLY=($(compgen -f -- "$cur")); }
            return
          fi ;;
      -*) ;;
      *) [[ -z $verb ]] && verb=${COMP_WORDS[i]} ;;
    esac
  done
  case $prev in
    --socket|--shim) compopt -o filenames 2>/dev/null; COMPREPLY=($(compgen -f -- "$cur")); return ;;
    --tenant) COMPREPLY=($(compgen -W "$(_cushare_tenants "$socket" "$user")" -- "$cur")); return ;;
    --priority) COMPREPLY=($(compgen -W "high normal low" -- "$cur")); return ;;
    --broker-user) COMPREPLY=($(compgen -u -- "$cur")); return ;;
    --memory|--threads|--device|--interval|--count) return ;;
  esac
  if [[ -z $verb ]]; then
    if [[ $cur == -* ]]; then
      COMPREPLY=($(compgen -W "--socket --broker-user --json --help --version" -- "$cur"))
    else
      COMPREPLY=($(compgen -W "$(_cushare_words)" -- "$cur"))
    fi
    return
  fi
  if [[ $cur == -* ]]; then
    COMPREPLY=($(compgen -W "$(_cushare_words "$verb")" -- "$cur"))
  elif [[ $verb == set-limit || $verb == tenants ]] && [[ $prev == "$verb" ]]; then
    COMPREPLY=($(compgen -W "$(_cushare_tenants "$socket" "$user")" -- "$cur"))
  fi
}
complete -F _cushare cushare

_cushare_broker() {
  local cur=${COMP_WORDS[COMP_CWORD]} prev=${COMP_WORDS[COMP_CWORD-1]}
  case $prev in
    --config) compopt -o filenames 2>/dev/null; COMPREPLY=($(compgen -f -- "$cur")); return ;;
    --log-level) COMPREPLY=($(compgen -W "error warn info debug" -- "$cur")); return ;;
    --log-format) COMPREPLY=($(compgen -W "text json" -- "$cur")); return ;;
  esac
  COMPREPLY=($(compgen -W "--config --check --log-level --log-format --help --version" -- "$cur"))
}
complete -F _cushare_broker cushare-broker
