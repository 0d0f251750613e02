package livebench

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"time"
)

// maxEvent bounds one SSE line.
const maxEvent = 1 << 20

// chunk is the part of a chat completion chunk the client reads.
type chunk struct {
	Choices []struct {
		Delta struct {
			Content string `json:"content"`
		} `json:"delta"`
	} `json:"choices"`
	Usage *struct {
		PromptTokens     int `json:"prompt_tokens"`
		CompletionTokens int `json:"completion_tokens"`
	} `json:"usage"`
	Error json.RawMessage `json:"error"`
}

// measure reads an SSE chat completion stream sent at t0, stamping each
// line as it is read, as vLLM's benchmark_serving does: TTFT is the time
// to the first chunk with non-empty content (benchmark_serving takes the
// first chunk with choices, which for vLLM and the simulator is the role
// chunk sent just before the first token), ITL the gaps between content
// chunks, E2E the time to the end of the body. Comment lines, other
// fields and [DONE] are skipped. A read error (other than the end of the
// body) is returned; a stream error event or a chunk that is not JSON
// fails res with ReasonStream.
func measure(body io.Reader, now func() time.Time, t0 time.Time, res *Result) error {
	br := bufio.NewReaderSize(body, 32<<10)
	var last time.Time
	for {
		line, err := readLine(br)
		ts := now()
		if len(line) > 0 {
			if !measureLine(line, ts, t0, &last, res) {
				res.E2E = ts.Sub(t0)
				return nil
			}
		}
		if err == io.EOF {
			res.E2E = ts.Sub(t0)
			return nil
		}
		if err != nil {
			res.E2E = ts.Sub(t0)
			return err
		}
	}
}

// measureLine records one SSE line; it returns false when the stream
// failed.
func measureLine(line []byte, ts, t0 time.Time, last *time.Time, res *Result) bool {
	line = bytes.TrimSpace(line)
	data, ok := bytes.CutPrefix(line, []byte("data:"))
	if !ok {
		return true // blank, comment (":"), event:, id:, retry:
	}
	data = bytes.TrimSpace(data)
	if len(data) == 0 || string(data) == "[DONE]" {
		return true
	}
	var c chunk
	if err := json.Unmarshal(data, &c); err != nil {
		res.fail(ReasonStream, "chunk is not JSON: "+err.Error())
		return false
	}
	if len(c.Error) > 0 && string(c.Error) != "null" {
		res.fail(ReasonStream, "error event: "+string(truncate(c.Error, 256)))
		return false
	}
	if c.Usage != nil {
		res.PromptTokens, res.OutputTokens = c.Usage.PromptTokens, c.Usage.CompletionTokens
	}
	if len(c.Choices) == 0 || c.Choices[0].Delta.Content == "" {
		return true
	}
	if res.Chunks == 0 {
		res.TTFT = ts.Sub(t0)
	} else {
		res.ITL = append(res.ITL, ts.Sub(*last))
	}
	res.Chunks++
	*last = ts
	return true
}

// readLine reads one line (with its newline, if any); a line longer than
// maxEvent is an error.
func readLine(br *bufio.Reader) ([]byte, error) {
	line, err := br.ReadSlice('\n')
	if !errors.Is(err, bufio.ErrBufferFull) {
		return line, err
	}
	buf := append([]byte(nil), line...)
	for errors.Is(err, bufio.ErrBufferFull) {
		if len(buf) > maxEvent {
			return nil, errors.New("SSE line longer than 1 MiB")
		}
		line, err = br.ReadSlice('\n')
		buf = append(buf, line...)
	}
	return buf, err
}

func truncate(b []byte, n int) []byte {
	if len(b) > n {
		return b[:n]
	}
	return b
}
