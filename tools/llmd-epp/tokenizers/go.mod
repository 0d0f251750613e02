module github.com/daulet/tokenizers

go 1.26

require (
	github.com/dlclark/regexp2 v1.11.5
	golang.org/x/text v0.30.0
)
