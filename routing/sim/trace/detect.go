package trace

import "bytes"

// Format names a trace format, as bench's --format does.
const (
	FormatMooncake = "mooncake"
	FormatAzure    = "azure"
)

// DetectSize is how many leading bytes Detect wants: enough for a first
// line of the formats it knows.
const DetectSize = 64 << 10

// Detect names the format of a trace file from its first bytes (up to
// DetectSize): FormatMooncake when the first non-blank line is a JSON
// object, FormatAzure when it is the Azure 2023 CSV header, "" when
// neither (the caller's choice stands and its reader reports the lines).
func Detect(head []byte) string {
	head = bytes.TrimPrefix(head, []byte("\xef\xbb\xbf"))
	for len(head) > 0 {
		line := head
		if i := bytes.IndexByte(head, '\n'); i >= 0 {
			line, head = head[:i], head[i+1:]
		} else {
			head = nil
		}
		line = trimSpace(line)
		switch {
		case len(line) == 0:
			continue
		case line[0] == '{':
			return FormatMooncake
		case azureHeader(line) == nil:
			return FormatAzure
		}
		return ""
	}
	return ""
}
